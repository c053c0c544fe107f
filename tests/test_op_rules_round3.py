"""Aten-level sharding rules of the ops PyTorch's own DTensor tests exercise (layer / group norm,
embedding, fill, tril / triu, roll, cumprod, convolution, upsampling, edge padding, glu, diagonal,
pixel shuffle, aminmax, untagged elementwise ops, in-place forms of pointwise ops).

Each case, on a mesh of 2 ranks: the result and the gradients of every DTensor input equal torch on
the full tensors, no op of the forward or the backward took the replicated fallback
(``recording_fallbacks``), and the output keeps the sharded placement the rule promises.
"""
import torch
import torch.nn.functional as F

from tests.harness import run_dist

S0, S1, S2, R, P = ("S", 0), ("S", 1), ("S", 2), ("R",), ("P",)


def _placement(code):
    from hyper_parallel import Partial, Replicate, Shard
    return {"S": lambda: Shard(code[1]), "R": Replicate, "P": lambda: Partial("sum")}[code[0]]()


def _dtensor(x, code, mesh, rank):
    """``x`` laid out as ``code``; a Partial holds 1/3 and 2/3 of the value (pieces never equal)."""
    from hyper_parallel import DTensor, Replicate, distribute_tensor
    if code[0] == "P":
        local = x.detach() * ((rank + 1) / 3)
        dt = DTensor.from_local(local, mesh, [_placement(code)], shape=tuple(x.shape))
    else:
        dt = distribute_tensor(x.detach(), mesh, [_placement(code)] if code else [Replicate()])
    return dt.requires_grad_() if x.is_floating_point() else dt


def _full(t):
    from hyper_parallel import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _tensor_outputs(out):
    return [o for o in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(o)]


def _check(name, fn, inputs, mesh, rank, out_placement=None):
    """Run ``fn`` on the full tensors and on DTensors; return a list of failure strings."""
    from hyper_parallel.core.dtensor.dispatch.fallback import recording_fallbacks
    g = torch.Generator().manual_seed(len(name))
    refs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x, _ in inputs]
    dts = [_dtensor(x, code, mesh, rank) for x, code in inputs]
    want = _tensor_outputs(fn(*refs))
    with recording_fallbacks() as names:
        got = _tensor_outputs(fn(*dts))
        weights = [torch.randn(tuple(w.shape), generator=g) for w in want]
        grads = any(w.requires_grad for w in want)
        if grads:
            sum((_full(o) * w).sum() for o, w in zip(got, weights) if o.is_floating_point()).backward()
    failures = [f"{name}: took the fallback for {sorted(names)}"] if names else []
    for i, (o, w) in enumerate(zip(got, want)):
        if not torch.allclose(_full(o).detach(), w.detach(), atol=1e-5, rtol=1e-4, equal_nan=True):
            failures.append(f"{name}: output {i} differs from torch")
    if out_placement is not None and tuple(got[0].placements) != (_placement(out_placement),):
        failures.append(f"{name}: output placements {got[0].placements}, expected {out_placement}")
    if grads:
        sum((o * w).sum() for o, w in zip(want, weights) if o.is_floating_point()).backward()
        for i, (r, d) in enumerate(zip(refs, dts)):
            if r.grad is not None and not torch.allclose(_full(d.grad), r.grad, atol=5e-5, rtol=1e-4):
                failures.append(f"{name}: gradient of input {i} differs from torch")
    return failures


def _cases():
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)
    ids = torch.randint(0, 10, (5, 3), generator=g)
    return [
        ("native_layer_norm", lambda x, w, b: torch.native_layer_norm(x, [6], w, b, 1e-5),
         [(rnd(5, 3, 6), S0), (rnd(6), R), (rnd(6), R)], S0),
        ("native_layer_norm S(1)", lambda x, w, b: torch.native_layer_norm(x, [6], w, b, 1e-5),
         [(rnd(4, 3, 6), S1), (rnd(6), R), (rnd(6), R)], S1),
        ("embedding ids S(0)", lambda w, i: torch.embedding(w, i), [(rnd(10, 4), R), (ids, S0)], S0),
        ("embedding weight S(1)", lambda w, i: torch.embedding(w, i), [(rnd(10, 4), S1), (ids, R)], S2),
        ("fill", lambda x: torch.fill(x, 2.5), [(rnd(5, 4), S0)], S0),
        ("fill Partial", lambda x: torch.fill(x, 2.5), [(rnd(5, 4), P)], R),
        ("tril S(0) diagonal 1", lambda x: torch.tril(x, 1), [(rnd(7, 5), S0)], S0),
        ("triu S(1) diagonal -1", lambda x: torch.triu(x, -1), [(rnd(5, 7), S1)], S1),
        ("tril batch S(0)", lambda x: torch.tril(x), [(rnd(3, 4, 4), S0)], S0),
        ("tril_ in place", lambda x: x.clone().tril_(), [(rnd(7, 5), S0)], S0),
        ("roll other dim", lambda x: torch.roll(x, 2, 1), [(rnd(5, 4), S0)], S0),
        ("roll sharded dim", lambda x: torch.roll(x, 2, 0), [(rnd(5, 4), S0)], R),
        ("cumprod", lambda x: torch.cumprod(x, 1), [(rnd(5, 4), S0)], S0),
        ("conv2d", lambda x, w, b: F.conv2d(x, w, b, padding=1),
         [(rnd(4, 3, 6, 6), S0), (rnd(2, 3, 3, 3), R), (rnd(2), R)], S0),
        ("conv1d no bias", lambda x, w: F.conv1d(x, w), [(rnd(3, 2, 8), S0), (rnd(4, 2, 3), R)], S0),
        ("interpolate bilinear", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
         [(rnd(2, 4, 3, 3), S1)], S1),
        ("interpolate nearest", lambda x: F.interpolate(x, scale_factor=2), [(rnd(4, 2, 5), S0)], S0),
        ("group_norm", lambda x, w, b: F.group_norm(x, 2, w, b),
         [(rnd(4, 4, 3), S0), (rnd(4), R), (rnd(4), R)], S0),
        ("aminmax", lambda x: torch.aminmax(x, dim=1), [(rnd(5, 4), S0)], S0),
        ("glu", lambda x: F.glu(x, 1), [(rnd(5, 4), S0)], S0),
        ("diagonal", lambda x: torch.diagonal(x, 0, 0, 1), [(rnd(4, 4, 5), S2)], S0),
        ("pad reflect", lambda x: F.pad(x, (2, 1), mode="reflect"), [(rnd(4, 2, 5), S0)], S0),
        ("pad replicate", lambda x: F.pad(x, (1, 1, 2, 0), mode="replicate"), [(rnd(2, 4, 3, 3), S1)], S1),
        ("pixel_shuffle", lambda x: F.pixel_shuffle(x, 2), [(rnd(4, 8, 2, 2), S0)], S0),
        ("floor_divide", lambda x, y: torch.floor_divide(x, y), [(ids * 7 - 20, S0), (ids % 4 + 1, R)], S0),
        ("hardswish", lambda x: F.hardswish(x), [(rnd(5, 4), S0)], S0),
        ("logsigmoid", lambda x: F.logsigmoid(x), [(rnd(5, 4), S0)], S0),
        ("mish in place", lambda x: F.mish(x.clone(), inplace=True), [(rnd(5, 4), S0)], S0),
        ("abs_", lambda x: x.clone().abs_(), [(rnd(5, 4), S1)], S1),
    ]


def _rules_case(rank, world_size):
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    failures = []
    for name, fn, inputs, out in _cases():
        try:
            failures += _check(name, fn, inputs, mesh, rank, out)
        except Exception as exc:  # noqa: BLE001  (reported with the case's name)
            failures.append(f"{name}: raised {type(exc).__name__}: {exc}")
    failures += _crash_cases(mesh, rank)
    return failures


def _crash_cases(mesh, rank):
    """Two calls that crashed inside torch: an in-place op on a plain tensor with a DTensor operand
    (torch's linear_cross_entropy does it), and tensor_split with DTensor indices (a clear error)."""
    from hyper_parallel import Replicate, Shard, distribute_tensor
    failures = []
    x = torch.arange(6.0)
    plain = torch.ones(6)
    plain.mul_(distribute_tensor(x, mesh, [Shard(0)]))
    if not torch.equal(plain, x):
        failures.append("plain.mul_(DTensor): the plain tensor does not hold the full product")
    idx = distribute_tensor(torch.tensor([1, 3]), mesh, [Replicate()])
    try:
        torch.tensor_split(distribute_tensor(x, mesh, [Shard(0)]), idx)
        failures.append("tensor_split with DTensor indices: no error")
    except ValueError as exc:
        if "tensor_split" not in str(exc):
            failures.append(f"tensor_split: the error does not name the op: {exc}")
    return failures


def test_aten_rules_match_torch_without_fallback():
    per_rank = run_dist(2, _rules_case, timeout=300)
    failures = sorted(set(sum(per_rank, [])))
    assert not failures, "\n".join(failures)
