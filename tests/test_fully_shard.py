"""fully_shard (ZeRO-3 / HSDP) against one process: losses, every gradient and every weight after
AdamW steps (fp32 to 1e-5), on 2 and 4 ranks: uneven sizes (an empty shard included), HSDP 2×2,
TP × FSDP on (dp_shard, tp), dp × cp flattened with ContextParallel, reshard_after_forward True /
False, foreach and fused AdamW, clip_grad_norm_, summed gradients, gradient accumulation with
set_requires_gradient_sync(False), mixed precision (bf16 parameters, fp32 reduction) against the
same casts in one process, and the collectives of one step (count and prefetch order).
Each rank's batch is its own; the reference computes every rank's batch on one process."""
from tests.harness import run_dist


def _train(shard_fn, data_index, n_data, steps=2, optim_kwargs=None, clip=None, mp=None, what="",
           model_fn=None, batch_fn=None, local_input=None, average=True):
    """Train ``shard_fn(model)`` and a one-process reference side by side; compare every step."""
    import torch
    from tests import fully_shard_models as fm
    model_fn = model_fn or fm.net
    batch_fn = batch_fn or fm.batch
    ref = model_fn()
    model = shard_fn(model_fn())
    optim_kwargs = optim_kwargs or {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **optim_kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **optim_kwargs)
    mp_dtype = None if mp is None else mp.param_dtype
    for step in range(steps):
        x = batch_fn(step, data_index)
        loss = fm.loss_fn(model(x if local_input is None else local_input(x)))
        loss.backward()
        weight = 1.0 / n_data if average else 1.0
        losses = fm.reference_step(ref, step, range(n_data), weight, mp_dtype, batch_fn)
        if local_input is None:
            torch.testing.assert_close(loss.float(), losses[data_index].float(), atol=1e-5, rtol=1e-5)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            torch.testing.assert_close(fm.full(norm), ref_norm, atol=1e-5, rtol=1e-5)
        fm.assert_grads(model, ref, f"{what} step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    fm.assert_weights(model, ref, f"{what} after {steps} steps")
    for p in model.parameters():  # the optimizer saw sharded parameters with sharded state
        assert any(pl.is_shard(0) for pl in p.placements), p.placements
        for v in opt.state[p].values():
            assert getattr(v, "ndim", 0) == 0 or v.placements == p.placements
    return model


def _zero3(mesh, **kwargs):
    from tests import fully_shard_models as fm
    return lambda model: fm.shard_net(model, mesh, **kwargs)


def _collectives(rank, mesh, raf):
    """One step's collectives: per unit one all-gather (two when freed after forward) and one
    reduce-scatter, the next unit's all-gather issued before the current unit computes."""
    from hyper_parallel import get_platform
    from tests import fully_shard_models as fm
    model = fm.shard_net(fm.net(), mesh, reshard_after_forward=raf)
    events, gathered = [], []
    units = [model.blocks[0], model.blocks[1]]

    def compute(i):
        events.append(f"compute block {i}")
        gathered.append(sum(u._hp_fsdp_state.group.state != "sharded" for u in units))
    for i, block in enumerate(model.blocks):
        block.up.register_forward_pre_hook(lambda *a, i=i: compute(i))
    # the ranks' agreement checks of the first step (shape_check) are not the step's data traffic
    observer = (lambda op, nbytes, ranks: op != "shape_check" and events.append(op))
    get_platform().add_comm_observer(observer)
    try:
        fm.loss_fn(model(fm.batch(0, rank))).backward()
    finally:
        get_platform().remove_comm_observer(observer)
    # root, block 0 (prefetched by the root), block 1 (prefetched by block 0 before it computes)
    forward = ["all_gather", "all_gather", "all_gather", "compute block 0", "compute block 1"]
    backward = (["all_gather", "all_gather", "reduce_scatter", "reduce_scatter", "reduce_scatter"] if raf
                else ["reduce_scatter"] * 3)
    assert events == forward + backward, events
    if raf:  # block 0's all-gather was issued before block 1's gradients were reduced
        assert events.index("reduce_scatter") > len(forward) + 1
        assert gathered == [2, 1], gathered   # block 0 computing with block 1 prefetched; then block 1 alone
    assert all(u._hp_fsdp_state.group.state == "sharded" for u in units + [model])


def _memory_and_methods(rank, mesh, n):
    """Per-rank parameter + gradient + AdamW bytes are total / N (plus padding); unshard() / reshard()
    swap the whole parameters in and out; set_reshard_after_backward(False) keeps them gathered."""
    import torch
    from hyper_parallel import DTensor
    from tests import fully_shard_models as fm
    ref = fm.net()
    model = fm.shard_net(fm.net(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fm.loss_fn(model(fm.batch(0, rank))).backward()
    opt.step()
    held = sum(t.to_local().numel() for p in model.parameters() for t in [p, p.grad, *opt.state[p].values()]
               if t.ndim)
    total = 4 * sum(p.numel() for p in ref.parameters())
    padding = 4 * sum(-(-p.shape[0] // n) * n * p[0].numel() - p.numel() for p in ref.parameters())
    assert held <= (total + padding) / n, (held, total / n)
    block = model.blocks[0]
    block.unshard()
    assert not any(isinstance(p, DTensor) for p in block.parameters())
    for p, q in zip(block.parameters(), ref.blocks[0].parameters()):
        assert p.shape == q.shape
    block.reshard()
    assert all(isinstance(p, DTensor) for p in block.parameters())
    model.set_reshard_after_backward(False)
    fm.loss_fn(model(fm.batch(1, rank))).backward()
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    model.reshard()
    for b in model.blocks:
        b.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())


def _accumulation(rank, mesh, n):
    """Two micro-batches, the first under set_requires_gradient_sync(False): one reduction of the sum."""
    from hyper_parallel import CommDebugMode
    from tests import fully_shard_models as fm
    ref = fm.net()
    model = fm.shard_net(fm.net(), mesh)
    model.set_requires_gradient_sync(False)
    with CommDebugMode() as comm:
        fm.loss_fn(model(fm.batch(0, rank))).backward()
    assert "reduce_scatter" not in comm.get_comm_counts()
    assert all(p.grad is None for p in model.parameters())
    model.set_requires_gradient_sync(True)
    fm.loss_fn(model(fm.batch(1, rank))).backward()
    fm.reference_step(ref, 0, range(n), 1.0 / n)
    fm.reference_step(ref, 1, range(n), 1.0 / n)
    fm.assert_grads(model, ref, "accumulated")


def _small_world_case(rank, world_size):
    import torch
    from hyper_parallel import MixedPrecisionPolicy, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    _train(_zero3(mesh), rank, world_size, optim_kwargs={"fused": True}, clip=0.05, what="fused+clip")
    _train(_zero3(mesh, average=False), rank, world_size, optim_kwargs={"foreach": True}, average=False,
           what="sum")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _train(_zero3(mesh, mp_policy=mp), rank, world_size, mp=mp, what="bf16")
    for raf in (True, False):
        _collectives(rank, mesh, raf)
    _accumulation(rank, mesh, world_size)
    _memory_and_methods(rank, mesh, world_size)
    return True


def _large_world_case(rank, world_size):
    from hyper_parallel import ColwiseParallel, ContextParallel, RowwiseParallel, init_device_mesh
    from hyper_parallel import parallelize_module, shard_sequence
    from tests import fully_shard_models as fm
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    _train(_zero3(mesh, reshard_after_forward=False), rank, world_size, what="zero3 raf=False")
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    _train(_zero3(hsdp), rank, world_size, what="hsdp")
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))

    def tp_fsdp(model):
        for block in model.blocks:
            parallelize_module(block, root["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return fm.shard_net(model, root["dp_shard"])
    _train(tp_fsdp, root.get_local_rank(0), 2, what="tp x fsdp")
    cp_root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))

    def cp_fsdp(model):
        for block in model.blocks:
            ContextParallel(seq_dim=2, head_dim=1, use_local_output=True).apply(block.attn, cp_root["cp"])
        return fm.shard_net(model, cp_root["dp", "cp"].flatten("dp_cp"))
    _train(cp_fsdp, cp_root.get_local_rank(0), 2, what="dp x cp", model_fn=lambda: fm.net_attn(),
           batch_fn=fm.seq_batch, local_input=lambda x: shard_sequence(x, cp_root["cp"]))
    return True


def test_zero3_mixed_precision_accumulation_and_collectives_on_2_ranks():
    assert run_dist(2, _small_world_case) == [True] * 2


def test_zero3_hsdp_tp_and_cp_on_4_ranks():
    assert run_dist(4, _large_world_case) == [True] * 4
