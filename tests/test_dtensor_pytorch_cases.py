"""What PyTorch DTensor users expect (issue 23, item 7): PyTorch's own DTensor test cases, ported.

Each case names the PyTorch test it follows (test/distributed/tensor/...). Torch-only: these are
torch APIs (dtypes of collectives, strides, process groups, ParallelStyles on nn.Modules).
"""
import pytest

from tests.harness import run_dist


def _mesh(world_size):
    from hyper_parallel import init_device_mesh
    return init_device_mesh("cpu", (world_size,))


# ---------------------------------------------------------------- redistribute(forward_dtype=, backward_dtype=)
def _redistribute_dtypes(rank, world_size):
    """test_redistribute.py test_redistribute_forward_dtype / backward_dtype: the shard is cast
    before the collective (the bytes moved are bf16's), the result has forward_dtype; the gradient
    crosses the backward collective in backward_dtype and reaches the input in its own dtype."""
    import torch
    from hyper_parallel import CommDebugMode, Replicate, Shard, distribute_tensor
    mesh = _mesh(world_size)
    full = torch.randn(8, 6, dtype=torch.float32)
    dt = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    with CommDebugMode() as comm:
        out = dt.redistribute(mesh, [Replicate()], forward_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.placements == (Replicate(),)
    torch.testing.assert_close(out.to_local(), full.to(torch.bfloat16))
    sent = comm.get_total_bytes() if hasattr(comm, "get_total_bytes") else None
    assert sent is None or sent == (world_size - 1) * full[: 8 // world_size].numel() * 2, sent
    out.to_local().float().sum().backward()
    assert dt.grad.dtype == torch.float32 and dt.grad.placements == (Shard(0),)
    torch.testing.assert_close(dt.grad.full_tensor(), torch.ones(8, 6))
    # backward_dtype: the gradient is rounded to bf16 for the backward collective, then cast back
    dt2 = distribute_tensor(full, mesh, [Replicate()]).requires_grad_()
    out2 = dt2.redistribute(mesh, [Shard(0)], backward_dtype=torch.bfloat16)
    assert out2.dtype == torch.float32
    weight = torch.full((8, 6), 1.0 + 2 ** -12)   # not representable in bf16
    (out2 * distribute_tensor(weight, mesh, [Shard(0)])).sum().backward()
    assert dt2.grad.dtype == torch.float32
    torch.testing.assert_close(dt2.grad.full_tensor(), weight.to(torch.bfloat16).float(), atol=0, rtol=0)
    # same placements with a dtype: still cast (as PyTorch), not returned as is
    same = dt.redistribute(mesh, [Shard(0)], forward_dtype=torch.float64)
    assert same.dtype == torch.float64 and same.placements == (Shard(0),)
    return True


def test_redistribute_forward_and_backward_dtype():
    assert run_dist(2, _redistribute_dtypes) == [True] * 2


# ---------------------------------------------------------------- Replicate -> Partial
def _replicate_to_partial(rank, world_size):
    """test_redistribute.py test_replicate_to_partial: Partial(sum) splits the value into equal
    shares v / n on every rank (avg / max / min keep v); reducing gives v back."""
    import torch
    from hyper_parallel import Partial, Replicate, distribute_tensor
    from hyper_parallel.core.dtensor import init_device_mesh
    mesh = _mesh(world_size)
    full = torch.randn(4, 6)
    rep = distribute_tensor(full, mesh, [Replicate()])
    part = rep.redistribute(mesh, [Partial()])
    torch.testing.assert_close(part.to_local(), full / world_size)
    torch.testing.assert_close(part.full_tensor(), full)
    for op in ("avg", "max", "min"):
        p = rep.redistribute(mesh, [Partial(op)])
        torch.testing.assert_close(p.to_local(), full)
        torch.testing.assert_close(p.full_tensor(), full)
    # integers cannot be split exactly: the value on the first rank, zeros on the others
    ints = distribute_tensor(torch.arange(6), mesh, [Replicate()]).redistribute(mesh, [Partial()])
    assert torch.equal(ints.to_local(), torch.arange(6) if rank == 0 else torch.zeros(6, dtype=torch.long))
    assert torch.equal(ints.full_tensor(), torch.arange(6))
    # on a 2-D mesh, per mesh dim: shares of v / (n0 * n1) for Partial on both
    mesh2 = init_device_mesh("cpu", (2, world_size // 2))
    both = distribute_tensor(full, mesh2, [Replicate(), Replicate()]).redistribute(mesh2, [Partial(), Partial()])
    torch.testing.assert_close(both.to_local(), full / world_size)
    torch.testing.assert_close(both.full_tensor(), full)
    return True


def test_replicate_to_partial_splits_the_value():
    assert run_dist(4, _replicate_to_partial) == [True] * 4


# ---------------------------------------------------------------- distribute_tensor of a DTensor
def _distribute_a_dtensor(rank, world_size):
    """test_dtensor.py test_distribute_tensor / DTensorAPITest: a DTensor with the requested layout is
    returned as is; with other placements (or another mesh) distribute_tensor raises."""
    import torch
    from hyper_parallel import Replicate, Shard, distribute_tensor
    from hyper_parallel.core.dtensor import init_device_mesh
    mesh = _mesh(world_size)
    dt = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    assert distribute_tensor(dt, mesh, [Shard(0)]) is dt
    assert distribute_tensor(dt, mesh, [Shard(-2)]) is dt
    with pytest.raises(ValueError, match=r"placements \(S\(0\),\) to placements .*redistribute"):
        distribute_tensor(dt, mesh, [Replicate()])
    with pytest.raises(ValueError, match="redistribute"):
        distribute_tensor(dt, mesh, [Shard(1)])
    other = init_device_mesh("cpu", (2, world_size // 2))
    with pytest.raises(ValueError, match="another mesh"):
        distribute_tensor(dt, other, [Shard(0), Replicate()])
    return True


def test_distribute_tensor_of_a_dtensor_with_other_placements_raises():
    assert run_dist(4, _distribute_a_dtensor) == [True] * 4


# ---------------------------------------------------------------- PrepareModuleInput
def _prepare_input_lengths(rank, world_size):
    """test_parallelize_api / test_tp_style.py test_prepare_module_input: more (or fewer) inputs
    than input_layouts is a ValueError, on every rank before any collective."""
    import torch
    from hyper_parallel import PrepareModuleInput, Replicate, Shard, parallelize_module

    class Two(torch.nn.Module):
        def forward(self, a, b=None, c=None):
            return a

    mesh = _mesh(world_size)
    style = PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None))
    mod = parallelize_module(Two(), mesh, style)
    x = torch.ones(2, 3)
    out = mod(x, x)   # two inputs, two layouts
    assert tuple(out.shape) == (2 * world_size, 3)
    with pytest.raises(ValueError, match=r"2 input_layouts .* got 3 positional inputs"):
        mod(x, x, x)
    with pytest.raises(ValueError, match="got 1 positional inputs"):
        mod(x)
    return True


def test_prepare_module_input_with_more_inputs_than_layouts_raises():
    assert run_dist(2, _prepare_input_lengths) == [True] * 2


# ---------------------------------------------------------------- strides of permuted shards
def _permuted_strides(rank, world_size):
    """test_dtensor.py test_dtensor_stride / test_view_ops: stride() and is_contiguous() of
    transposed / permuted DTensors are those torch gives the same view of the full tensor."""
    import torch
    from hyper_parallel import Replicate, Shard, distribute_tensor
    mesh = _mesh(world_size)
    full = torch.randn(8, 4, 6)
    for placements in ([Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]):
        dt = distribute_tensor(full, mesh, placements)
        assert dt.stride() == full.stride() and dt.is_contiguous()
        for view in (lambda t: t.transpose(0, 1), lambda t: t.permute(2, 0, 1), lambda t: t.mT,
                     lambda t: t.permute(1, 2, 0).transpose(0, 2)):
            for _ in range(2):   # the second call takes the dispatch fast path
                got, want = view(dt), view(full)
                assert got.stride() == want.stride(), (placements, got.stride(), want.stride())
                assert got.is_contiguous() == want.is_contiguous()
                torch.testing.assert_close(got.full_tensor(), want)
        back = dt.transpose(0, 2).contiguous()
        assert back.is_contiguous() and back.stride() == full.transpose(0, 2).contiguous().stride()
    # PyTorch's own case: a (x, y) tensor sharded on dim 0, transposed
    dt = distribute_tensor(torch.randn(8 * world_size, 6), mesh, [Shard(0)]).t()
    assert dt.stride() == (1, 6) and not dt.is_contiguous()
    return True


def test_strides_of_permuted_shards_match_torch():
    assert run_dist(2, _permuted_strides) == [True] * 2


# ---------------------------------------------------------------- DeviceMesh.from_group
def _from_group(rank, world_size):
    """test_device_mesh.py test_from_group: a mesh over an existing group (1-D, and 2-D from one
    group per dim with mesh=), usable for DTensors; mismatching groups are a ValueError."""
    import torch
    import torch.distributed as dist
    from hyper_parallel import DeviceMesh, Shard, distribute_tensor
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    world = platform.new_group(range(world_size))
    mesh = DeviceMesh.from_group(world, "cpu", mesh_dim_names=("dp",))
    assert mesh.rank_list == tuple(range(world_size)) and mesh.get_group() is world
    full = torch.arange(8.0 * world_size)
    assert torch.equal(distribute_tensor(full, mesh, [Shard(0)]).full_tensor(), full)
    # 2-D: rows and columns of a 2 x (n/2) grid, groups made with torch itself (every rank makes all)
    cols = world_size // 2
    grid = torch.arange(world_size).reshape(2, cols)
    rows = [dist.new_group(grid[i].tolist()) for i in range(2)]
    columns = [dist.new_group(grid[:, j].tolist()) for j in range(cols)]
    mine = (columns[rank % cols], rows[rank // cols])
    mesh2 = DeviceMesh.from_group(list(mine), "cpu", mesh=grid, mesh_dim_names=("dp", "tp"))
    assert mesh2.get_coordinate() == (rank // cols, rank % cols)
    assert mesh2["tp"].rank_list == tuple(grid[rank // cols].tolist())
    assert mesh2["tp"].get_group() is mine[1]
    dt = distribute_tensor(full.reshape(2 * world_size, 4), mesh2, [Shard(0), Shard(1)])
    assert torch.equal(dt.full_tensor(), full.reshape(2 * world_size, 4))
    with pytest.raises(ValueError, match="group 0 has ranks"):
        DeviceMesh.from_group(list(reversed(mine)), "cpu", mesh=grid)
    with pytest.raises(ValueError, match="needs mesh="):
        DeviceMesh.from_group(list(mine), "cpu")
    return True


def test_device_mesh_from_group():
    assert run_dist(4, _from_group) == [True] * 4


# ---------------------------------------------------------------- local_map / implicit_replication
def _local_map_cases(rank, world_size):
    """test_local_map.py: a plain-tensor function on shards (row-wise matmul: x Shard(0) @ w
    Replicate -> Shard(0)), forward and gradients equal one process; in_placements mismatch is a
    ValueError unless redistribute_inputs=True; implicit_replication mixes plain tensors."""
    import torch
    from hyper_parallel import (CommDebugMode, Partial, Replicate, Shard, distribute_tensor,
                                implicit_replication, local_map)
    mesh = _mesh(world_size)
    x_full, w_full = torch.randn(4 * world_size, 3), torch.randn(3, 5)

    @local_map(out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]),
               in_grad_placements=([Shard(0)], [Partial()]), device_mesh=mesh)
    def row_matmul(x, w):
        assert type(x) is torch.Tensor and type(w) is torch.Tensor
        return x @ w

    x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(w_full, mesh, [Replicate()]).requires_grad_()
    row_matmul(x, w)   # from_local checks the ranks agree on a signature's first call
    with CommDebugMode() as comm:
        out = row_matmul(x, w)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), x_full @ w_full)
    out.full_tensor().sum().backward()
    xr, wr = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    (xr @ wr).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), xr.grad)
    torch.testing.assert_close(w.grad.full_tensor(), wr.grad)
    # in another layout: an error, or a redistribution when asked
    x_rep = distribute_tensor(x_full, mesh, [Replicate()])
    with pytest.raises(ValueError, match="in_placements asks for .*redistribute_inputs=True"):
        row_matmul(x_rep, w)
    moved = local_map(lambda a, b: a @ b, [Shard(0)], ([Shard(0)], [Replicate()]),
                      redistribute_inputs=True)(x_rep, w)
    torch.testing.assert_close(moved.full_tensor(), x_full @ w_full)
    # several outputs, one not a tensor; plain tensors only: the function runs as is
    pair = local_map(lambda a: (a.sum(0), a.shape[0]), out_placements=([Partial()], None))(x)
    torch.testing.assert_close(pair[0].full_tensor(), x_full.sum(0))
    assert pair[1] == 4
    assert type(row_matmul(x_full, w_full)) is torch.Tensor
    with implicit_replication():
        mixed = x + torch.ones(3)   # the plain tensor counts as Replicate
        torch.testing.assert_close(mixed.full_tensor(), x_full + 1)
    return True


def test_local_map_and_implicit_replication():
    assert run_dist(2, _local_map_cases) == [True] * 2


# ---------------------------------------------------------------- register_sharding
def _rowscale_op():
    import torch

    @torch.library.custom_op("hp_test::rowscale", mutates_args=())
    def rowscale(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * s[:, None]

    @rowscale.register_fake
    def _(x, s):
        return torch.empty_like(x)
    return rowscale


def _register_sharding_cases(rank, world_size):
    """test_register_sharding.py: a strategy registered for a custom op (sharded rows in, sharded
    rows out) runs it on the shards with no communication; registered by name, it replaces a
    built-in rule (softmax kept replicated)."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import CommDebugMode, Replicate, Shard, distribute_tensor, register_sharding
    from hyper_parallel.core.dtensor.ops.user_sharding import unregister_sharding
    ops = getattr(torch.ops, "hp_test", None)
    op = ops.rowscale.default if ops is not None and hasattr(ops, "rowscale") else None
    if op is None:
        _rowscale_op()
        op = torch.ops.hp_test.rowscale.default
    mesh = _mesh(world_size)
    x_full, s_full = torch.randn(4 * world_size, 3), torch.randn(4 * world_size)
    x, s = distribute_tensor(x_full, mesh, [Shard(0)]), distribute_tensor(s_full, mesh, [Shard(0)])
    seen = []

    @register_sharding(op)
    def rowscale_sharding(x_spec, s_spec):
        seen.append((tuple(x_spec.shape), x_spec.placements))
        return [([Replicate()], [Replicate(), Replicate()]), ([Shard(0)], [Shard(0), Shard(0)])]
    try:
        with CommDebugMode() as comm:
            out = op(x, s)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert out.placements == (Shard(0),) and seen == [((4 * world_size, 3), (Shard(0),))]
        torch.testing.assert_close(out.full_tensor(), x_full * s_full[:, None])
        # a replicated scale: the cheapest acceptable layout slices it locally, still no collective
        s_rep = distribute_tensor(s_full, mesh, [Replicate()])
        with CommDebugMode() as comm:
            out = op(x, s_rep)
        assert comm.get_total_counts() == 0 and out.placements == (Shard(0),), comm.get_comm_counts()
        torch.testing.assert_close(out.full_tensor(), x_full * s_full[:, None])
    finally:
        unregister_sharding(op)

    @register_sharding("softmax")
    def replicated_softmax(x_spec, *rest, **kwargs):   # dim=1 comes as a keyword
        return [([Replicate()], [Replicate()] + [None] * len(rest))]
    try:
        y = distribute_tensor(x_full, mesh, [Shard(0)])
        got = F.softmax(y, dim=1)
        assert got.placements == (Replicate(),)
        torch.testing.assert_close(got.full_tensor(), F.softmax(x_full, dim=1))
    finally:
        unregister_sharding("softmax")
    assert F.softmax(y, dim=1).placements == (Shard(0),)   # the built-in rule again
    return True


def test_register_sharding():
    assert run_dist(2, _register_sharding_cases) == [True] * 2


# ---------------------------------------------------------------- ops that left the replicated fallback
def _no_fallback_ops(rank, world_size):
    """test_dtensor_ops.py's ops that took the replicated fallback (forward or backward): the
    gradients of chunk / split / unbind / hstack (aten cat / stack / split), softmin and
    _safe_softmax (aten _softmax, _softmax_backward_data), dot / vdot / inner, constant padding.
    Each now runs through a rule: forward and gradient equal one device, no fallback."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import Replicate, Shard, distribute_tensor
    from hyper_parallel.core.dtensor.dispatch.fallback import recording_fallbacks
    mesh = _mesh(world_size)
    cases = {
        "chunk": (lambda t: torch.cat([c * (i + 1) for i, c in enumerate(t.chunk(2, 1))], 1), (6, 8)),
        "split": (lambda t: torch.stack([c.sum(1) for c in t.split([3, 5], 1)]), (6, 8)),
        "unbind": (lambda t: sum(u * (i + 1) for i, u in enumerate(t.unbind(1))), (6, 4)),
        "hstack": (lambda t: torch.hstack([t, 2 * t]), (6, 4)),
        "softmin": (lambda t: F.softmin(t, dim=1), (6, 5)),
        "safe_softmax": (lambda t: torch.ops.aten._safe_softmax(t, 1), (6, 5)),
        "dot": (lambda t: torch.dot(t, t.flip(0)), (8,)),
        "inner": (lambda t: torch.inner(t, 2 * t), (8,)),
        "pad": (lambda t: F.pad(t, (1, 2), value=0.5), (6, 4)),
        "constant_pad_nd": (lambda t: torch.constant_pad_nd(t, (0, 0, 1, 1)), (6, 4)),
    }
    failures = []
    for name, (fn, shape) in cases.items():
        full = torch.randn(shape, dtype=torch.float64)
        ref = full.clone().requires_grad_()
        want = fn(ref)
        weight = torch.randn(want.shape, dtype=torch.float64)
        (want * weight).sum().backward()
        dt = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        with recording_fallbacks() as fell_back:
            got = fn(dt)
            (got * distribute_tensor(weight, mesh, [Replicate()])).sum().backward()
        if fell_back:
            failures.append(f"{name}: fallback for {sorted(fell_back)}")
        torch.testing.assert_close(got.full_tensor(), want.detach(), msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(dt.grad.full_tensor(), ref.grad, msg=lambda m: f"{name} grad: {m}")
    assert not failures, failures
    return True


def test_former_fallback_ops_run_through_rules():
    assert run_dist(2, _no_fallback_ops) == [True] * 2
