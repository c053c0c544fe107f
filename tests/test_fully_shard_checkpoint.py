"""fully_shard: meta-device initialisation (each rank allocates only its shard; the result equals
one process), torch.distributed.checkpoint of model and AdamW state saved on 4 ranks and loaded
into 2 ranks (training continues as in one process) and into one process as plain tensors, and the
ValueErrors every rank raises before any collective, and a rank that skips a step failing the
others within the mesh's timeout."""
from tests.harness import run_dist

STEPS = 2


def _optim_state(model, opt):
    """AdamW's state by parameter name (the form a checkpoint can reshard)."""
    return {name: opt.state[p] for name, p in model.named_parameters()}


def _fresh_state(model, opt):
    import torch
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}
    return _optim_state(model, opt)


def _reference(n_data, steps):
    import torch
    from tests import fully_shard_models as fm
    ref = fm.net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        fm.reference_step(ref, step, range(n_data), 1.0 / n_data)
        opt.step()
        opt.zero_grad()
    return ref, opt


def _step(model, opt, step, rank):
    from tests import fully_shard_models as fm
    fm.loss_fn(model(fm.batch(step, rank))).backward()
    opt.step()
    opt.zero_grad()


def _save_case(rank, world_size, path):
    """Meta init, two steps on 4 ranks, then a checkpoint of the model and the optimizer."""
    import torch
    import torch.distributed.checkpoint as dcp
    from hyper_parallel import init_device_mesh
    from tests import fully_shard_models as fm
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = fm.Net()
    fm.shard_net(model, mesh)
    model.to_empty(device="cpu")
    for p in model.parameters():  # only this rank's rows exist
        rows = p.shape[0]
        step = -(-rows // world_size)
        mine = max(0, min(step, rows - rank * step))
        local = p.to_local()
        assert local.shape[0] == mine and local.untyped_storage().nbytes() == local.numel() * 4, p.shape
    torch.manual_seed(0)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    fm.assert_weights(model, fm.net(), "meta init")   # sharded random init draws the one-process values
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        _step(model, opt, step, rank)
    ref, _ = _reference(world_size, STEPS)
    fm.assert_weights(model, ref, "meta init, trained")
    dcp.save({"model": model.state_dict(), "optim": _optim_state(model, opt)}, checkpoint_id=path)
    return True


def _load_case(rank, world_size, path):
    """Load the 4-rank checkpoint into 2 ranks and take one more step: equal to one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from hyper_parallel import init_device_mesh
    from tests import fully_shard_models as fm
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = fm.shard_net(fm.net(seed=7), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model.state_dict(), "optim": _fresh_state(model, opt)}
    dcp.load(state, checkpoint_id=path)
    ref, ref_opt = _reference(4, STEPS)
    fm.assert_weights(model, ref, "loaded")
    _step(model, opt, STEPS, rank)
    fm.reference_step(ref, STEPS, range(world_size), 1.0 / world_size)
    ref_opt.step()
    fm.assert_weights(model, ref, "loaded, one more step")
    _errors(rank, world_size)
    return True


def _errors(rank, world_size):
    """Every rank raises the same ValueError, naming the value and the fix, before any collective."""
    import pytest
    import torch
    from hyper_parallel import MixedPrecisionPolicy, fully_shard, init_device_mesh
    from tests import fully_shard_models as fm
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    cube = init_device_mesh("cpu", (1, 1, world_size), mesh_dim_names=("a", "b", "c"))
    with pytest.raises(ValueError, match="dp_replicate"):
        fully_shard(fm.net(), cube)
    with pytest.raises(ValueError, match="mp_policy"):
        fully_shard(fm.net(), mesh, mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="param_dtype=torch.int32"):
        MixedPrecisionPolicy(param_dtype=torch.int32)
    with pytest.raises(ValueError, match="reshard_after_forward"):
        fully_shard(fm.net(), mesh, reshard_after_forward=2)
    model = fully_shard(fm.net(), mesh)
    with pytest.raises(ValueError, match="already applied"):
        fully_shard(model, mesh)
    with torch.device("meta"):
        meta = fm.Net()
    fully_shard(meta, mesh)
    with pytest.raises(ValueError, match="to_empty"):
        meta(fm.batch(0, rank))


def _skipped_forward(rank, world_size, timeout):
    """A rank that skips the step makes the other fail in fully_shard's all-gather within the
    mesh's timeout, with an error naming the collective (a timeout no other case uses: its gloo
    group is not used again)."""
    import pytest
    from hyper_parallel import init_device_mesh
    from tests import fully_shard_models as fm
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",), timeout=timeout)
    model = fm.shard_net(fm.net(), mesh)
    if rank == world_size - 1:
        return None
    # the step's first collective: the ranks' agreement check of the first forward (an AgreementTimeoutError,
    # a ValueError and a TimeoutError), then all-gathers
    with pytest.raises(TimeoutError, match="shape_check|all_gather"):
        model(fm.batch(0, rank))
    return True


def test_a_rank_that_skips_the_step_fails_the_others_within_the_timeout():
    assert run_dist(2, _skipped_forward, 2.75, timeout=60) == [True, None]


def test_meta_init_and_checkpoint_4_to_2_to_1(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from tests import fully_shard_models as fm
    path = str(tmp_path / "ckpt")
    assert run_dist(4, _save_case, path) == [True] * 4
    assert run_dist(2, _load_case, path) == [True] * 2
    # one process, plain tensors
    model = fm.net(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model.state_dict(), "optim": _fresh_state(model, opt)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    ref, ref_opt = _reference(4, STEPS)
    fm.assert_weights(model, ref, "one process")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], atol=1e-6, rtol=1e-5,
                                       msg=lambda m: f"{name} {key}: {m}")
        assert float(opt.state[p]["step"]) == STEPS
