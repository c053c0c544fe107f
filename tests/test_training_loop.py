"""An ordinary PyTorch training loop on DTensor parameters, exactly as on one device: stock
optimizers at their defaults and on their foreach / fused paths, gradient clipping and the total
gradient norm. Each rank trains a Colwise -> Rowwise MLP (plus a replicated norm) and compares
every parameter with the same training in one process (fp32, 1e-5). One ``run_dist`` per world
size covers every configuration.
"""
import pytest

from tests.harness import run_dist

DIM, HIDDEN = 8, 12   # 12 hidden units: uneven shards on 8 ranks would be covered elsewhere; even on 2 and 4
TOL = {"atol": 1e-5, "rtol": 1e-5}

OPTIMIZERS = [
    ("AdamW", {"foreach": True}), ("Adam", {"foreach": True}), ("AdamW", {}), ("Adam", {"fused": True}),
    ("AdamW", {"fused": True}), ("Adam", {"foreach": True, "amsgrad": True}),
    ("SGD", {"momentum": 0.9}), ("SGD", {"momentum": 0.9, "foreach": True, "nesterov": True}),
    ("SGD", {"momentum": 0.9, "fused": True}),
]


def _model():
    import torch.nn as nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.up = nn.Linear(DIM, HIDDEN)
            self.down = nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            return self.down(self.up(self.norm(x)).relu())

    return MLP()


def _train(model, opt, clip=None, steps=3):
    """``steps`` steps of a fixed loss; the total norms seen (clip: (max_norm, norm_type, foreach))."""
    import torch
    norms = []
    for step in range(steps):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        if clip is not None:
            max_norm, norm_type, foreach = clip
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type, foreach=foreach)
            norms.append(_full(norm))
        opt.step()
        opt.zero_grad()
    return norms


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _pair(opt_name, opt_kwargs, mesh, replicate_rest=False):
    """(reference model, its optimizer, TP model, its optimizer) from one seed. ``replicate_rest``:
    the LayerNorm's parameters become Replicate DTensors too (distribute_module), else stay plain."""
    import torch
    from hyper_parallel import ColwiseParallel, RowwiseParallel, distribute_module, parallelize_module
    torch.manual_seed(0)
    ref = _model()
    torch.manual_seed(0)
    tp = parallelize_module(_model(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if replicate_rest:
        distribute_module(tp, mesh)
    make = getattr(torch.optim, opt_name)
    lr = {"lr": 0.05}
    return ref, make(ref.parameters(), **lr, **opt_kwargs), tp, make(tp.parameters(), **lr, **opt_kwargs)


def _check_params(ref, tp, what):
    import torch
    for (name, p_ref), (_, p_tp) in zip(ref.named_parameters(), tp.named_parameters()):
        torch.testing.assert_close(_full(p_tp).detach(), p_ref.detach(), **TOL, msg=f"{what}: {name}")


def _optimizers_case(rank, world_size):
    import warnings
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no op may fall back to gathering: every step runs on shards
        for opt_name, opt_kwargs in OPTIMIZERS:
            ref, ref_opt, tp, tp_opt = _pair(opt_name, opt_kwargs, mesh)
            _train(ref, ref_opt)
            _train(tp, tp_opt)
            _check_params(ref, tp, f"{opt_name}({opt_kwargs})")
    return len(OPTIMIZERS)


def _clipping_case(rank, world_size):
    import torch
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    # plain and DTensor gradients mixed (the LayerNorm left plain) on the foreach path; all DTensor
    # on both paths
    for clip, replicate_rest in [((0.05, 2.0, True), False), ((0.01, float("inf"), True), False),
                                 ((0.05, 2.0, True), True), ((0.05, 2.0, False), True),
                                 ((0.1, 1.0, None), True), ((100.0, 3.0, True), True)]:
        ref, ref_opt, tp, tp_opt = _pair("SGD", {}, mesh, replicate_rest)
        ref_norms = _train(ref, ref_opt, clip)
        tp_norms = _train(tp, tp_opt, clip)
        for a, b in zip(tp_norms, ref_norms):
            torch.testing.assert_close(a, b, **TOL, msg=f"clip {clip}: total norm")
        _check_params(ref, tp, f"clip {clip}")
    # get_total_norm over a list of gradients, both paths
    ref, _, tp, _ = _pair("SGD", {}, mesh, replicate_rest=True)
    for model in (ref, tp):
        model(torch.ones(2, DIM)).sum().backward()
    for foreach in (True, False):
        got = torch.nn.utils.get_total_norm([p.grad for p in tp.parameters()], 2.0, foreach=foreach)
        want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], 2.0)
        torch.testing.assert_close(_full(got), want, **TOL)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_optimizers_match_one_device(world_size):
    assert run_dist(world_size, _optimizers_case) == [len(OPTIMIZERS)] * world_size


def test_clip_grad_norm_matches_one_device():
    assert run_dist(4, _clipping_case) == [True] * 4
