"""Redistribution (SPEC §4): every placement pair on 1-D(4), 2-D(2x2) and 3-D(2x2x2) meshes,
uneven shapes, StridedShard, gradients and the collectives each plan issues.

The case lists are built deterministically in the test process and sent to the ranks, so every
rank runs the same sequence. A rank builds its source shard from the case alone; it returns its
destination shard, and the test process checks every rank's shard against a reference written
here from the definitions (``torch.chunk`` pieces; Partial pieces that reduce to the global tensor),
independent of the library's layout code. The collectives each plan issues are also checked on
MindSpore (tests/cases/redistribute.py); the conversions of every placement pair run on both
platforms in test_dtensor_api.py.
"""
import itertools
import random

import pytest

from tests.cases import redistribute as neutral
from tests.harness import run_dist
from tests.harness.frameworks import FRAMEWORKS, run_on

BASIC = ("S0", "S1", "S-1", "R", "Psum", "Pavg", "Pmax")

# StridedShard layouts with the order in which their mesh dims split each tensor dim (outermost
# first), written out by hand from the definition: SS(d, k) applies after the later mesh dims (of
# total size k) that split d.
STRIDED = {
    (2, 2): [
        (("SS0:2", "S0"), {0: [1, 0]}),
        (("SS1:2", "S1"), {1: [1, 0]}),
        (("SS-1:2", "S-1"), {-1: [1, 0]}),
    ],
    (2, 2, 2): [
        (("SS0:2", "S0", "R"), {0: [1, 0]}),
        (("SS0:2", "R", "S0"), {0: [2, 0]}),
        (("R", "SS1:2", "S1"), {1: [2, 1]}),
        (("SS0:4", "S0", "S0"), {0: [1, 2, 0]}),
        (("S0", "SS0:2", "S0"), {0: [0, 2, 1]}),
        (("SS0:4", "SS0:2", "S0"), {0: [2, 1, 0]}),
        (("SS0:2", "S0", "S1"), {0: [1, 0], 1: [2]}),
        (("Pmax", "SS1:2", "S1"), {1: [2, 1]}),
    ],
}


# ============================================================================ shared reference code
def _parse(code):
    from hyper_parallel.core.dtensor import Partial, Replicate, Shard, StridedShard
    if code == "R":
        return Replicate()
    if code.startswith("P"):
        return Partial(code[1:])
    if code.startswith("SS"):
        dim, factor = code[2:].split(":")
        return StridedShard(int(dim), int(factor))
    return Shard(int(code[1:]))


def _orders(codes, ndim, strided_orders=None):
    """Per tensor dim, the mesh dims that split it, outermost first (plain shards: mesh order)."""
    if strided_orders is not None:
        orders = {d % ndim: list(o) for d, o in strided_orders.items()}
    else:
        orders = {}
    for m, code in enumerate(codes):
        if code.startswith("S") and not code.startswith("SS"):
            d = int(code[1:]) % ndim
            if d in orders and m in orders[d]:
                continue
            orders.setdefault(d, []).append(m)
    return orders


def _box(shape, codes, mesh_shape, coord, strided_orders=None):
    """Index tensors per tensor dim of the piece held at ``coord`` (torch.chunk semantics)."""
    import torch
    orders = _orders(codes, len(shape), strided_orders)
    box = []
    for d, length in enumerate(shape):
        idx = torch.arange(length)
        for m in orders.get(d, []):
            chunks = idx.chunk(mesh_shape[m]) if len(idx) else ()
            idx = chunks[coord[m]] if coord[m] < len(chunks) else idx[:0]
        box.append(idx)
    return box


def _take(tensor, box):
    for d, idx in enumerate(box):
        tensor = tensor.index_select(d, idx)
    return tensor


def _coords(mesh_shape):
    return list(itertools.product(*[range(n) for n in mesh_shape]))


def _inputs(case, mesh_shape):
    """(global tensor, {coord: full-size piece}) for a case: the pieces reduce to the global tensor
    over the source's Partial mesh dims, in any order (sum/avg pieces are zero-mean noise per dim;
    on a max dim only coordinate 0 holds the value, the others hold less)."""
    import torch
    shape, src, dst, seed = case[:4]
    gen = torch.Generator().manual_seed(seed)
    ndim_mesh = len(mesh_shape)
    global_ = torch.randn(shape, generator=gen, dtype=torch.float64)
    pieces = global_.expand(tuple(mesh_shape) + tuple(shape)).clone()
    for m, code in enumerate(src):
        if code in ("Psum", "Pavg"):
            noise_shape = [1] * ndim_mesh + list(shape)
            noise_shape[m] = mesh_shape[m]
            noise = torch.randn(noise_shape, generator=gen, dtype=torch.float64)
            noise = noise - noise.mean(dim=m, keepdim=True)
            pieces = (pieces / mesh_shape[m] if code == "Psum" else pieces) + noise
    max_dims = [m for m, code in enumerate(src) if code == "Pmax"]
    if max_dims:
        gap = torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5
        for coord in _coords(mesh_shape):
            k = sum(1 for m in max_dims if coord[m] != 0)
            pieces[coord] -= k * gap
    return global_, {c: pieces[c] for c in _coords(mesh_shape)}


def _reduce(stacked, code, dim):
    if code == "Psum":
        return stacked.sum(dim)
    if code == "Pavg":
        return stacked.mean(dim)
    if code == "Pmax":
        return stacked.amax(dim)
    return stacked.amin(dim)


# ============================================================================ case generation
def _shape(rng, ndim):
    return tuple(rng.choice([1, 2, 3, 5, 6, 7, 9]) for _ in range(ndim))


def _cases(mesh_shape, seed):
    """Deterministic cases ``(shape, src, dst, seed, strided_src, strided_dst)``: every per-mesh-dim
    pair of BASIC on every mesh dim (the other dims random), plus StridedShard to/from cases."""
    rng = random.Random(seed)
    ndim = len(mesh_shape)
    cases = []

    def add(src, dst, s_src=None, s_dst=None, shape=None):
        shape = shape or _shape(rng, rng.choice([2, 3]))
        cases.append((shape, tuple(src), tuple(dst), rng.randrange(1 << 30), s_src, s_dst))

    for m in range(ndim):
        for a, b in itertools.product(BASIC, BASIC):
            src = [rng.choice(BASIC) for _ in range(ndim)]
            dst = [rng.choice(BASIC) for _ in range(ndim)]
            src[m], dst[m] = a, b
            add(src, dst)
    if ndim == 1:  # 1-D: every pair once more on a 3-D tensor
        for a, b in itertools.product(BASIC, BASIC):
            add([a], [b], shape=_shape(rng, 3))
    for codes, orders in STRIDED.get(tuple(mesh_shape), []):
        plain = [c.replace("SS", "S").split(":")[0] for c in codes]
        others = [[rng.choice(BASIC) for _ in range(ndim)] for _ in range(2)]
        add(codes, plain, s_src=orders)
        add(plain, codes, s_dst=orders)
        add(codes, ["R"] * ndim, s_src=orders)
        add(["Psum"] * ndim, codes, s_dst=orders)
        add(codes, others[0], s_src=orders)
        add(others[1], codes, s_dst=orders)
    return cases


# ============================================================================ the property test
def _run_cases(rank, world_size, mesh_shape, cases):
    import torch
    from hyper_parallel.core.dtensor import DTensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    out = []
    for case in cases:
        shape, src, dst, _, s_src, s_dst = case
        global_, pieces = _inputs(case, mesh_shape)
        local = _take(pieces[coord], _box(shape, src, mesh_shape, coord, s_src))
        dt = DTensor.from_local(local, mesh, [_parse(c) for c in src], shape=shape)
        assert tuple(dt.shape) == tuple(shape)
        res = dt.redistribute(mesh, [_parse(c) for c in dst])
        want = tuple(_parse(c).normalized(len(shape)) for c in dst)
        assert res.placements == want, (case, res.placements, want)
        assert tuple(res.shape) == tuple(shape), case
        full = res.full_tensor()
        torch.testing.assert_close(full, global_, atol=1e-9, rtol=1e-9,
                                   msg=lambda m: f"full_tensor() after {case}: {m}")
        out.append(res.to_local().clone())
    return out


def _verify(mesh_shape, cases, per_rank):
    """Every rank's destination shard against the reference."""
    import torch
    coords = _coords(mesh_shape)
    failures = []
    for i, case in enumerate(cases):
        shape, src, dst, _, _, s_dst = case
        global_, _ = _inputs(case, mesh_shape)
        partial_dims = [m for m, c in enumerate(dst) if c.startswith("P")]
        held = {}  # coordinate over the Partial dims -> reassembled full-size tensor
        try:
            for rank, coord in enumerate(coords):
                local = per_rank[rank][i]
                box = _box(shape, dst, mesh_shape, coord, s_dst)
                assert tuple(local.shape) == tuple(len(b) for b in box), \
                    f"rank {rank}: local shape {tuple(local.shape)} != {tuple(len(b) for b in box)}"
                key = tuple(coord[m] for m in partial_dims)
                if key not in held:
                    held[key] = torch.full(shape, float("nan"), dtype=torch.float64)
                region = held[key]
                index = torch.meshgrid(*box, indexing="ij") if box else ()
                if local.numel():
                    current = region[index]
                    known = ~torch.isnan(current)
                    # replicas must agree
                    torch.testing.assert_close(local[known], current[known], atol=1e-9, rtol=1e-9)
                    region[index] = local
                if not partial_dims:
                    torch.testing.assert_close(local, _take(global_, box), atol=1e-9, rtol=1e-9)
            assert not any(torch.isnan(t).any() for t in held.values()), "pieces do not tile"
            if partial_dims:
                sizes = [mesh_shape[m] for m in partial_dims]
                stacked = torch.stack([held[k] for k in itertools.product(*[range(s) for s in sizes])])
                stacked = stacked.reshape(tuple(sizes) + tuple(shape))
                for j, m in reversed(list(enumerate(partial_dims))):
                    stacked = _reduce(stacked, dst[m], j)
                torch.testing.assert_close(stacked, global_, atol=1e-9, rtol=1e-9)
        except AssertionError as exc:
            failures.append(f"{case}: {exc}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (8,), (2, 2), (2, 2, 2)],
                         ids=["1d2", "1d4", "1d8", "2d2x2", "3d2x2x2"])
def test_redistribute_every_pair(mesh_shape):
    import math
    cases = _cases(mesh_shape, seed=sum(mesh_shape) * 1000 + len(mesh_shape))
    per_rank = run_dist(math.prod(mesh_shape), _run_cases, mesh_shape, cases, timeout=300)
    _verify(mesh_shape, cases, per_rank)


def test_reference_self_check():
    """The reference itself: Partial pieces reduce to the global tensor in every order, and the
    strided orders written above match the definition on a small example."""
    import torch
    mesh_shape = (2, 2, 2)
    case = ((3, 5), ("Psum", "Pmax", "Pavg"), ("R", "R", "R"), 7, None, None)
    global_, pieces = _inputs(case, mesh_shape)
    stacked = torch.stack([pieces[c] for c in _coords(mesh_shape)]).reshape(mesh_shape + (3, 5))
    for perm in itertools.permutations(range(3)):
        value = stacked
        dims = list(range(3))
        for m in perm:
            j = dims.index(m)
            value = _reduce(value, case[1][m], j)
            dims.pop(j)
        torch.testing.assert_close(value, global_)
    # (SS(0,2), S(0)) on 2x2: rank (i, j) holds chunk i of chunk j
    t = torch.arange(8)
    for i, j in _coords((2, 2)):
        box = _box((8,), ("SS0:2", "S0"), (2, 2), (i, j), {0: [1, 0]})
        assert box[0].tolist() == t.chunk(2)[j].chunk(2)[i].tolist()


# ============================================================================ gradients
def _grad_cases(rank, world_size, mesh_shape, cases):
    import torch
    from hyper_parallel.core.dtensor import DTensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    for case in cases:
        shape, src, dst, seed, s_src, s_dst = case
        _, pieces = _inputs(case, mesh_shape)
        weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        src_p = [_parse(c) for c in src]
        dst_p = [_parse(c) for c in dst]
        grad_codes = ["R" if c.startswith("P") else c for c in src]
        want_grad = _take(weight, _box(shape, grad_codes, mesh_shape, coord, s_src))
        want_placements = tuple(_parse(c).normalized(len(shape)) for c in grad_codes)
        local = _take(pieces[coord], _box(shape, src, mesh_shape, coord, s_src))

        # (a) a plain leaf through from_local; loss on the full tensor
        leaf = local.clone().requires_grad_()
        y = DTensor.from_local(leaf, mesh, src_p, shape=shape).redistribute(mesh, dst_p)
        assert y.requires_grad
        (y.full_tensor() * weight).sum().backward()
        torch.testing.assert_close(leaf.grad, want_grad, msg=lambda m: f"{case} (a): {m}")

        # (b) a DTensor leaf: its .grad is a DTensor in the source placements (Partial -> R)
        x = DTensor.from_local(local.clone(), mesh, src_p, shape=shape).requires_grad_()
        y = x.redistribute(mesh, dst_p)
        if not any(c.startswith("P") for c in dst):
            # per-rank loss on the local shard: the gradient of a replicated value is not summed
            w_local = _take(weight, _box(shape, dst, mesh_shape, coord, s_dst))
            (y.to_local() * w_local).sum().backward()
        else:
            (y.full_tensor() * weight).sum().backward()
        assert isinstance(x.grad, DTensor), (case, type(x.grad))
        assert x.grad.placements == want_placements, (case, x.grad.placements, want_placements)
        torch.testing.assert_close(x.grad.to_local(), want_grad, msg=lambda m: f"{case} (b): {m}")
        torch.testing.assert_close(x.grad.full_tensor(), weight, msg=lambda m: f"{case} (b) full: {m}")
    return len(cases)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (8,), (2, 2)], ids=["1d2", "1d4", "1d8", "2d2x2"])
def test_redistribute_gradients(mesh_shape):
    import math
    rng = random.Random(99 + len(mesh_shape))
    if len(mesh_shape) == 1:
        cases = [c for c in _cases(mesh_shape, seed=5) if len(c[0]) == 2]  # all 49 pairs
    else:
        cases = rng.sample(_cases(mesh_shape, seed=6), 40)
        cases += [c for c in _cases(mesh_shape, seed=7) if c[4] or c[5]]  # every strided case
    n = run_dist(math.prod(mesh_shape), _grad_cases, mesh_shape, cases, timeout=300)
    assert n == [len(cases)] * math.prod(mesh_shape)


# ============================================================================ collectives per plan
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_redistribute_collectives(framework):
    """One collective per step, counted on both platforms (bytes where the collectives are native:
    MindSpore's CPU emulations send more, see test_mindspore_collectives)."""
    assert run_on(framework, 4, neutral.collectives_per_plan, framework == "torch") == [True] * 4


def test_redistribute_fewest_bytes():
    results = run_dist(4, neutral.fewest_bytes)
    assert results[0] == [], results[0]
