"""Single-device semantics that a distributed tensor most easily loses, each against torch on the
full tensor, on every layout of 1-D meshes of 2 and 4 ranks (uneven and empty shards included) and
a 2x2 mesh: writes through indexing and views, in-place ops on Partial values, NaN in reductions,
random ops under one seed, complex views. The op sweep (test_op_sweep.py) covers torch's op
database; these are the patterns it cannot express (``d[idx] = v``, a write through a kept view).
"""
import pytest

from tests.harness import run_dist

MESHES = [(2,), (4,), (2, 2)]


def _layouts(mesh, ndim, partial=True):
    """Every placement tuple over the mesh dims (Shard of any dim, Replicate, Partial)."""
    import itertools
    from hyper_parallel import Partial, Replicate, Shard
    choices = [Replicate()] + [Shard(d) for d in range(ndim)] + ([Partial()] if partial else [])
    return list(itertools.product(choices, repeat=mesh.ndim))


def _dt(x, mesh, placements):
    """A DTensor with ``placements`` whose global value is ``x`` (Partial: uneven pieces)."""
    import torch
    from hyper_parallel import DTensor, Replicate, distribute_tensor
    base = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(x, mesh, base, src_data_rank=None).to_local().clone()
    for m, p in enumerate(placements):
        if p.is_partial():
            n, c = mesh.size(m), mesh.get_coordinate()[m]
            noise = torch.arange(local.numel(), dtype=local.dtype).reshape(local.shape) * 0.25
            local = local / n + (noise if c == 0 else -noise / (n - 1))
    return DTensor.from_local(local, mesh, placements, shape=tuple(x.shape))


def _check(name, dtensor, expected, failures):
    import torch
    try:
        got = dtensor.full_tensor()
        assert tuple(dtensor.to_local().shape) == dtensor._spec.local_shape, "local shape off its layout"
        torch.testing.assert_close(got, expected, equal_nan=True, atol=1e-5, rtol=1e-5)
    except AssertionError as exc:
        failures.append(f"{name} {dtensor.placements}: {exc}")


# ================================================================================ writes
WRITES = {
    "d[:, 0] = 0": lambda t: t.__setitem__((slice(None), 0), 0.0),
    "d[1:3] = 0": lambda t: t.__setitem__(slice(1, 3), 0.0),
    "d[1:3] = d2[1:3] * 2": lambda t: t.__setitem__(slice(1, 3), t[1:3] * 2),
    "d[..., 1] += 5": lambda t: t[..., 1].add_(5.0),
    "v = d[1:3]; v.mul_(0)": lambda t: t[1:3].mul_(0),
    "v = d[:, 1:]; v.zero_()": lambda t: t[:, 1:].zero_(),
    "v = d.t(); v[0].fill_(7)": lambda t: t.t()[0].fill_(7.0),
    "v = d.view(-1); v[3] = -1": lambda t: t.view(-1).__setitem__(3, -1.0),
    "d.view(-1)[2:7].t().zero_() (a chain)": lambda t: t.view(-1)[2:7].unsqueeze(0).t().zero_(),
    "chunk(2)[1].mul_(3)": lambda t: t.chunk(2)[1].mul_(3),
    "d.add_(1)": lambda t: t.add_(1.0),
    "d.mul_(2).add_(1)": lambda t: t.mul_(2).add_(1),
    "d.exp_()": lambda t: t.exp_(),
    "d.clamp_(max=0.5)": lambda t: t.clamp_(max=0.5),
    "relu(d, inplace=True)": lambda t: __import__("torch").nn.functional.relu(t, inplace=True),
    "d.copy_(d * 3)": lambda t: t.copy_(t * 3),
}


def writes_case(rank, world_size, mesh_shape):
    import torch
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    failures, count = [], 0
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    for name, write in WRITES.items():
        want = x.clone()
        write(want)
        for placements in _layouts(mesh, 2):
            d = _dt(x, mesh, placements)
            try:
                write(d)
            except (NotImplementedError, ValueError):
                continue  # refusing is allowed; a wrong value is not
            count += 1
            assert tuple(d.placements) == tuple(placements), f"{name}: placements changed to {d.placements}"
            _check(name, d, want, failures)
    assert not failures, "\n".join(failures[:10])
    return count


def inplace_partial_case(rank, world_size, mesh_shape):
    """Every in-place pointwise op on a Partial(sum) target: scalars are added once, non-linear
    ops see the reduced value, and the target stays Partial."""
    import torch
    from hyper_parallel import Partial
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    failures = []
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    ops = {"add_(1)": lambda t: t.add_(1), "sub_(2)": lambda t: t.sub_(2.0), "mul_(3)": lambda t: t.mul_(3),
           "pow_(2)": lambda t: t.pow_(2), "sigmoid_": lambda t: t.sigmoid_(), "abs_": lambda t: t.abs_(),
           "clamp_min_(0)": lambda t: t.clamp_min_(0), "addcmul_": lambda t: t.addcmul_(t, t, value=0.5)}
    placements = tuple(Partial() if m == 0 else p for m, p in enumerate(_layouts(mesh, 2, partial=False)[1]))
    for name, op in ops.items():
        want = x.clone()
        op(want)
        d = _dt(x, mesh, placements)
        op(d)
        assert tuple(d.placements) == placements, f"{name}: placements changed to {d.placements}"
        _check(name, d, want, failures)
    assert not failures, "\n".join(failures)
    return len(ops)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_writes_through_indexing_and_views_reach_the_dtensor(mesh_shape):
    world = 1
    for n in mesh_shape:
        world *= n
    counts = run_dist(world, writes_case, mesh_shape, timeout=240)
    assert counts[0] == counts[-1] and counts[0] >= len(WRITES) * 3


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_inplace_ops_on_partial_values(mesh_shape):
    world = 2 if len(mesh_shape) == 1 else 4
    assert run_dist(world, inplace_partial_case, mesh_shape) == [8] * world


# ================================================================================ NaN, random, complex
NAN_REDUCTIONS = {
    "max()": lambda t: t.max(), "min()": lambda t: t.min(), "amax(0)": lambda t: t.amax(0),
    "amin(1)": lambda t: t.amin(1), "amax()": lambda t: t.amax(), "max(0).values": lambda t: t.max(0).values,
    "sum(1)": lambda t: t.sum(1), "mean()": lambda t: t.mean(), "softmax(1)": lambda t: t.softmax(1),
}


def nan_case(rank, world_size, mesh_shape):
    """A NaN (and, separately, an inf) in one shard reaches the result as on one device."""
    import torch
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    failures, count = [], 0
    for value in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
        x[4, 5] = value  # in the last rank's piece of either dim
        for name, op in NAN_REDUCTIONS.items():
            want = op(x)
            for placements in _layouts(mesh, 2, partial=False):
                count += 1
                _check(f"{name} with {value}", op(_dt(x, mesh, placements)), want, failures)
    assert not failures, "\n".join(failures[:10])
    return count


def random_case(rank, world_size, mesh_shape):
    """Random ops on sharded DTensors draw what one device draws under the same seed."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    failures, count = [], 0
    ops = {"dropout": lambda t: F.dropout(t, 0.4),
           "dropout(inplace)": lambda t: F.dropout(t, 0.3, inplace=True),
           "rand_like": torch.rand_like, "randn_like": torch.randn_like,
           "bernoulli_(0.3)": lambda t: t.bernoulli_(0.3), "uniform_": lambda t: t.uniform_(-1, 1),
           "normal_": lambda t: t.normal_(), "bernoulli(sigmoid)": lambda t: torch.bernoulli(t.sigmoid())}
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(3))
    for name, op in ops.items():
        for placements in _layouts(mesh, 2):
            torch.manual_seed(11)
            want = op(x.clone())
            d = _dt(x, mesh, placements)
            torch.manual_seed(11)
            got = op(d)
            count += 1
            _check(name, got, want, failures)
            if got.placements != d.placements and not any(p.is_partial() for p in d.placements):
                failures.append(f"{name} {placements}: output placements {got.placements}")
    # the generators stayed in step on every rank: the next draw agrees everywhere
    probe = torch.rand(4)
    gathered = [torch.zeros(4) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, probe)
    assert all(torch.equal(g, probe) for g in gathered), "ranks' generators diverged"
    assert not failures, "\n".join(failures[:10])
    return count


def dropout_grad_case(rank, world_size, mesh_shape):
    """Sharded dropout's gradient is the single-device one (the same mask)."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import Shard, init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    w = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(21)
    (F.dropout(x, 0.5) * w).sum().backward()
    d = _dt(x.detach(), mesh, (Shard(1),) * mesh.ndim).requires_grad_()
    torch.manual_seed(21)
    (F.dropout(d, 0.5).full_tensor() * w).sum().backward()
    torch.testing.assert_close(d.grad.full_tensor(), x.grad)
    return 1


def complex_view_case(rank, world_size, mesh_shape):
    """RoPE in complex form: view_as_complex -> multiply -> view_as_real on sharded tensors."""
    import torch
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    failures, count = [], 0
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(6))
    freqs = torch.polar(torch.ones(6, 4), torch.randn(6, 4, generator=torch.Generator().manual_seed(7)))

    def rope(t):
        pairs = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs).flatten(-2)
    want = rope(x)
    for placements in _layouts(mesh, 3):
        d = _dt(x, mesh, placements)
        got = rope(d)
        count += 1
        if tuple(got.shape) != tuple(want.shape):
            failures.append(f"{placements}: global shape {tuple(got.shape)} != {tuple(want.shape)}")
            continue
        _check("rope", got, want, failures)
    assert not failures, "\n".join(failures[:10])
    return count


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_nan_and_inf_reach_reductions_as_on_one_device(mesh_shape):
    world = 2 if mesh_shape == (2,) else 4
    counts = run_dist(world, nan_case, mesh_shape, timeout=240)
    assert counts[0] >= 3 * len(NAN_REDUCTIONS) * 3


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_random_ops_equal_single_device_under_one_seed(mesh_shape):
    world = 2 if mesh_shape == (2,) else 4
    counts = run_dist(world, random_case, mesh_shape, timeout=240)
    assert counts[0] >= 8 * 4


def test_sharded_dropout_gradient_equals_single_device():
    assert run_dist(2, dropout_grad_case, (2,)) == [1, 1]


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_complex_views_keep_global_shapes(mesh_shape):
    world = 2 if mesh_shape == (2,) else 4
    assert run_dist(world, complex_view_case, mesh_shape)[0] >= 5


def write_grad_case(rank, world_size):
    """Writes into a non-leaf DTensor that autograd tracks (``e[1:3] = 0``, ``e[:, 1] += 1``, and
    through a kept view ``v = e[2:]; v.mul_(3)``): values and gradients are the single-device ones."""
    import torch
    from hyper_parallel import Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(8), requires_grad=True)
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(9))

    def writes(t):
        y = t * 2
        y[1:3] = 0
        y[:, 1] += 1
        v = y[2:]
        v.mul_(3)
        return y
    y = writes(x)
    (y * w).sum().backward()
    checked = 0
    for placements in [(Shard(0),), (Shard(1),)]:
        d = _dt(x.detach(), mesh, placements).requires_grad_()
        e = writes(d)
        (e.full_tensor() * w).sum().backward()
        torch.testing.assert_close(e.full_tensor(), y.detach())
        torch.testing.assert_close(d.grad.full_tensor(), x.grad)
        # a transpose is a view autograd does not know as one: a write through it must raise
        with pytest.raises(ValueError, match="requires grad"):
            (d * 2).t().mul_(2)
        checked += 1
    return checked


def test_writes_into_tracked_dtensors_keep_gradients():
    assert run_dist(2, write_grad_case) == [2, 2]
