"""fully_shard (ZeRO-3 / HSDP) against one process: losses, every gradient and every weight after
AdamW steps (fp32 to 1e-5), on 2 and 4 ranks, uneven sizes, HSDP 2×2, reshard_after_forward
True / False, foreach and fused AdamW, clip_grad_norm_, gradient accumulation and mixed precision.
Each rank's batch is its own; the reference computes every rank's batch on one process."""
from tests.harness import run_dist


def _train(rank, mesh, data_index, n_data, steps=3, optim_kwargs=None, clip=None, mp=None, what="", **fs_kwargs):
    """Train a fully_shard'ed Net and a one-process reference side by side; compare every step."""
    import torch
    from tests import fully_shard_models as fm
    ref = fm.net()
    model = fm.shard_net(fm.net(), mesh, mp_policy=mp, **fs_kwargs)
    optim_kwargs = optim_kwargs or {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **optim_kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **optim_kwargs)
    mp_dtype = None if mp is None else mp.param_dtype
    for step in range(steps):
        x = fm.batch(step, data_index)
        loss = fm.loss_fn(model(x if mp_dtype is None else x))
        loss.backward()
        weight = 1.0 / n_data if fs_kwargs.get("average", True) else 1.0
        losses = fm.reference_step(ref, step, range(n_data), weight, mp_dtype)
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
    for p in model.parameters():  # the optimizer saw sharded parameters and sharded state
        assert p.placements[-1].is_shard(0), p.placements
        assert all(getattr(v, "placements", p.placements) == p.placements for v in opt.state[p].values()
                   if getattr(v, "ndim", 0))
    return model


def _zero3_case(rank, world_size):
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for raf in (True, False):
        _train(rank, mesh, rank, world_size, reshard_after_forward=raf, what=f"raf={raf}")
    _train(rank, mesh, rank, world_size, optim_kwargs={"fused": True}, clip=0.05, what="fused+clip")
    _train(rank, mesh, rank, world_size, optim_kwargs={"foreach": True}, average=False, what="sum")
    return True


def test_zero3_matches_one_process_2_and_4_ranks():
    assert run_dist(2, _zero3_case) == [True] * 2
    assert run_dist(4, _zero3_case) == [True] * 4
