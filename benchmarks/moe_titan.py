"""torchtitan 0.3's expert-parallel token dispatch beside ours (``python -m benchmarks.moe``).

Both sides move the same tokens of the same routing over the same ranks: dispatch, an identity
"expert" (so only the dispatch is compared), combine, and the backward of both, timed interleaved.
torchtitan's dispatcher is ``torchtitan.models.common.token_dispatcher.AllToAllTokenDispatcher`` on
a torch DeviceMesh; its grouped experts need ``torch._grouped_mm`` (bf16, CUDA-oriented), which is
why the experts are left out of this comparison. Anything that stops it here is reported.
"""
import statistics
import time


def _titan_round(torch, dispatcher, x, scores, index, experts):
    counts = torch.bincount(index.flatten(), minlength=experts)
    routed, _per_expert, meta = dispatcher.dispatch(x, scores, index, counts)
    out = dispatcher.combine(routed, meta, x)
    out.pow(2).sum().backward()


def _our_round(torch, group, n, x, scores, index, experts):
    from hyper_parallel.core.expert_parallel import dispatch_combine
    out = dispatch_combine(x, index, scores, experts, group, n, lambda rows, _sizes: rows)
    out.pow(2).sum().backward()


def try_torchtitan(torch, args, mesh, x):
    """{"status": "ran", ms of both, max |difference| of the outputs} or {"status": "skipped", "reason"}."""
    try:
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh
        from torchtitan.distributed import utils as titan_utils
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
        titan_utils.set_spmd_backend("full_dtensor")   # functional collectives on the ep group
        n = args.nproc
        dispatcher = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=args.experts,
                                                                            top_k=args.top_k))
        dispatcher.wire_meshes(ep_mesh=torch_mesh("cpu", (n,), mesh_dim_names=("ep",)))
        g = torch.Generator().manual_seed(torch.distributed.get_rank())
        scores, index = torch.rand(x.shape[0], args.experts, generator=g).softmax(-1).topk(args.top_k, -1)
        xs = [x.detach().clone().requires_grad_(True) for _ in range(2)]
        group = mesh.get_group(0)
        _titan_round(torch, dispatcher, xs[0], scores, index, args.experts)
        _our_round(torch, group, n, xs[1], scores, index, args.experts)
        diff = float((xs[0].grad - xs[1].grad).abs().max())
        times = {"torchtitan AllToAllTokenDispatcher": [], "hyper_parallel dispatch_combine": []}
        for _ in range(args.rounds):
            rounds = (lambda: _titan_round(torch, dispatcher, x.detach().requires_grad_(True), scores, index,
                                           args.experts),
                      lambda: _our_round(torch, group, n, x.detach().requires_grad_(True), scores, index,
                                         args.experts))
            for name, fn in zip(times, rounds):
                torch.distributed.barrier()
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
        return {"status": "ran",
                "dispatch_combine_fwd_bwd_ms": {k: statistics.median(v) for k, v in times.items()},
                "max_grad_difference": diff}
    except Exception as exc:  # noqa: BLE001  (the peer is optional: report why it is absent)
        return {"status": "skipped", "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}
