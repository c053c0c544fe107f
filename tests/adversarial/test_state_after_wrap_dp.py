"""data_parallel when state changes after wrapping, or ranks disagree (SPEC §9, §19), against one
process: each backward's gradient is reduced exactly once (two backward() calls without no_sync,
summed or averaged; no_sync after a reduced backward), parameters frozen, unfrozen or added after
wrapping train as in one process (weights after SGD steps); backward counts or models that differ
across ranks raise the same ValueError on every rank (checked by text). parallelize_model's
unreduced-dim warning: a ("dp", "tp") mesh without data_parallel warns at the first forward,
naming the dim and the fix; with data_parallel(model, mesh["dp"]) it does not."""
import pytest

from tests.harness import run_dist

ADOPTED = ("two_backward_sum", "two_backward_mean", "no_sync_after_reduced", "frozen", "unfrozen", "added")
REFUSED = {
    "backward_counts": "data_parallel: the ranks of DeviceMesh('cpu', [0, 1], mesh_dim_names=('dp',)) ran "
                       "different numbers of backward passes since their last forward",
    "models_differ": "data_parallel: the ranks of DeviceMesh('cpu', [0, 1], mesh_dim_names=('dp',)) disagree "
                     "on their shapes (rank",
}


def _mesh(world_size):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",), timeout=30)


def _net(wide=5):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, wide), torch.nn.Tanh(), torch.nn.Linear(wide, 3))


def _x(step, r):
    import torch
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + r))


def _loss(model, step, r):
    return model(_x(step, r)).pow(2).sum()


def _close(model, ref, what, grads=False):
    import torch
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        a, b = (p.grad, q.grad) if grads else (p, q)
        assert (a is None) == (b is None), (what, name)
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{what} {name}")


def _accumulate(case, rank, world_size):
    """Several backward passes into one gradient: one process's sum (or mean) over ranks."""
    from hyper_parallel import data_parallel
    average = case != "two_backward_sum" and case != "no_sync_after_reduced"
    model, ref = data_parallel(_net(), _mesh(world_size), average=average), _net()
    scale = 1.0 / world_size if average else 1.0
    for step in range(3):
        if case == "no_sync_after_reduced" and step == 1:
            with model.no_sync():
                _loss(model, step, rank).backward()
        else:
            _loss(model, step, rank).backward()
        (scale * sum(_loss(ref, step, r) for r in range(world_size))).backward()
    _close(model, ref, case, grads=True)


def _changed(case, rank, world_size):
    """A parameter frozen, unfrozen or added after wrapping: SGD steps equal one process."""
    import torch
    from hyper_parallel import data_parallel
    model, ref = _net(), _net()
    if case == "unfrozen":
        model[0].weight.requires_grad_(False)
    model = data_parallel(model, _mesh(world_size))
    for m in (model, ref):
        if case == "frozen":
            m[2].weight.requires_grad_(False)
        if case == "added":
            torch.manual_seed(1)
            m.append(torch.nn.Linear(3, 2))
    model[0].weight.requires_grad_(True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(2):
        _loss(model, step, rank).backward()
        (sum(_loss(ref, step, r) for r in range(world_size)) / world_size).backward()
        _close(model, ref, f"{case} step {step}", grads=True)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    _close(model, ref, case)


def _refused(case, rank, world_size):
    from hyper_parallel import data_parallel
    model = data_parallel(_net(wide=5 + (case == "models_differ" and rank == 1)), _mesh(world_size))
    for step in range(2):
        loss = _loss(model, step, rank)
        loss.backward(retain_graph=True)
        if case == "backward_counts" and rank == 0 and step == 0:
            loss.backward()   # rank 0 reduces twice after one forward


def _unreduced_dim_warning(rank, world_size):
    """parallelize_model's check of mesh dims no wrapper reduces (integrations/hf_fully_shard.py)."""
    import warnings
    import torch
    from hyper_parallel import data_parallel, init_device_mesh
    from hyper_parallel.integrations.hf_fully_shard import warn_unreduced_dims
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    seen = []
    for wrap in (False, True):
        model = torch.nn.Linear(2, 2)
        warn_unreduced_dims(model, mesh, {"tp"})
        if wrap:
            data_parallel(model, mesh["dp"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(torch.ones(1, 2))
            model(torch.ones(1, 2))   # once, at the first forward
        seen.append([str(w.message) for w in caught if "parallelize_model" in str(w.message)])
    return seen


def _table(rank, world_size, cases):
    results = {}
    for case in cases:
        try:
            if case in ADOPTED:
                (_accumulate if "backward" in case or "sync" in case else _changed)(case, rank, world_size)
            else:
                _refused(case, rank, world_size)
            results[case] = "ok"
        except ValueError as exc:
            results[case] = str(exc)
    results["warning"] = _unreduced_dim_warning(rank, world_size)
    return results


@pytest.mark.parametrize("world_size, cases", [
    (2, ADOPTED + tuple(REFUSED)),
    (4, ("two_backward_sum", "added")),
])
def test_state_changed_after_data_parallel(world_size, cases):
    for rank, results in enumerate(run_dist(world_size, _table, list(cases))):
        for case in cases:
            expected = REFUSED.get(case, "ok")
            assert expected in results[case], (rank, case, results[case])
        warned, wrapped = results["warning"]
        assert wrapped == [], wrapped
        assert len(warned) == 1 and warned[0].startswith(
            "parallelize_model: the gradients are reduced over no wrapper on mesh dim(s) ['dp']: the ranks "
            "along them hold replicas of the parameters that will drift apart. Wrap the model: "
            "data_parallel(model, mesh['dp']) after parallelize_model"), warned
