"""Mesh and lifecycle edges (issue 23, item 6), written once for torch and MindSpore workers.

No torch and no pytest here: the cases are imported by MindSpore workers too.
"""
import numpy as np

from tests.frameworks import close, current, expect_error, grad_of, inp, t


def outside_rank_slicing(rank, world_size):
    """A mesh over the first half of the ranks: its members slice the sub-mesh containing them; a
    rank outside gets a ValueError (it used to get the first sub-mesh, which it is not part of)."""
    from hyper_parallel import DeviceMesh
    half = world_size // 2
    grid = np.arange(half).reshape(1, half)
    mesh = DeviceMesh("cpu", grid, mesh_dim_names=("a", "b"))
    if rank < half:
        assert mesh["b"].rank_list == tuple(range(half))
        assert mesh["a"].rank_list == (rank,)
        assert mesh[("b", "a")].mesh_shape == (half, 1)
        return "member"
    assert mesh.get_coordinate() is None
    for names in ("a", "b", ("a", "b"), ("b", "a")):
        expect_error(ValueError, lambda: mesh[names], f"rank {rank} is not part of mesh", "get_coordinate")
    expect_error(ValueError, lambda: mesh.group_ranks(0), "not part of mesh")
    return "outside"


def mesh_shape_validation(rank, world_size):
    """Bad mesh shapes are a ValueError naming the value; one -1 is inferred from the world size."""
    from hyper_parallel import init_device_mesh
    for bad, fragment in [((-1, -2), "-2"), ((0, world_size), "[0]"), ((-1, -1), "-1"),
                          ((2.0, world_size // 2), "2.0"), ((world_size, 2), "holds"),
                          ((3, -1), "not divisible"), ((), "none")]:
        expect_error(ValueError, lambda: init_device_mesh("cpu", bad), "mesh_shape", fragment)
    from hyper_parallel import DeviceMesh
    expect_error(ValueError, lambda: DeviceMesh("cpu", [0, world_size]), f"rank(s) [{world_size}] outside")
    expect_error(ValueError, lambda: DeviceMesh("cpu", [[-1, 0]]), "rank(s) [-1] outside")
    mesh = init_device_mesh("cpu", (-1, 2), mesh_dim_names=("x", "y"))
    assert mesh.mesh_shape == (world_size // 2, 2), mesh.mesh_shape
    assert mesh.get_coordinate() == (rank // 2, rank % 2)
    return mesh.mesh_shape


def _hybrid_ref(H, S, causal):
    fw = current()
    q, k, v, w = (inp(f"dsco{name}", 0, (2, S, H, 4)) for name in "qkvw")
    ref_cell = fw.attention("sdpa", "bshd")

    def reference(a, b, c):
        return ref_cell(a, b, c, mask=None, causal=causal)
    ref_out = fw.numpy(reference(t(q), t(k), t(v)))
    ref_grads = [fw.numpy(g) for g in grad_of(lambda a, b, c: (reference(a, b, c) * t(w)).sum(),
                                                t(q), t(k), t(v))]
    return (q, k, v, w), ref_out, ref_grads


def shard_sequence_ds_co(rank, world_size, names, shape, style_kwargs, causal=True):
    """shard_sequence + ContextParallel on a 2-D CP mesh named ``names`` (("ds", "co") puts block
    c·ds + d at a rank that is not rank order) equals one process, forward and dq, dk, dv."""
    from hyper_parallel import ContextParallel, init_device_mesh, shard_sequence
    fw = current()
    H, S = 4, 16
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    # the block of this rank, from the grid alone: (co=c, ds=d) holds block c·ds + d
    coord = dict(zip(names, np.unravel_index(rank, shape)))
    ds = dict(zip(names, shape))["ds"]
    block = int(coord["co"]) * ds + int(coord["ds"])
    (q, k, v, w), ref_out, ref_grads = _hybrid_ref(H, S, causal)
    lb = style_kwargs.get("load_balance", False)
    cell = fw.attention("sdpa", "bshd")
    ContextParallel(seq_dim=1, head_dim=2, **style_kwargs).apply(cell, mesh)
    locals_ = shard_sequence([t(q), t(k), t(v)], mesh, seq_dim=1, load_balance=lb)
    w_local = shard_sequence(t(w), mesh, seq_dim=1, load_balance=lb)

    def run(a, b, c):
        return cell(a, b, c, mask=None, causal=causal)
    mine = (lambda x: np.split(x, world_size, axis=1)[block])
    for got, full in zip(locals_, (q, k, v)):
        close(got, mine(full), f"shard_sequence block on {names}")
    what = f"{names} {shape} {style_kwargs} causal={causal}"
    close(run(*locals_), mine(ref_out), "forward " + what)
    grads = grad_of(lambda a, b, c: (run(a, b, c) * w_local).sum(), *locals_)
    for name, g, ref in zip("qkv", grads, ref_grads):
        close(g, mine(ref), f"d{name} " + what)
    return block
