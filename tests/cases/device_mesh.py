"""DeviceMesh (SPEC §2) cases on any framework: world 4 (2x2) and 8 (2x2x2).

Every (sub-)mesh is checked against a rank grid computed independently with numpy, and every one of
its groups is made to communicate: an all-reduce of the global rank must give the sum of exactly the
expected ranks, and an all-gather must return them in mesh order.
"""
import numpy as np

from tests.frameworks import expect_error, np_of, t


def _line(grid, coord, dim):
    """The global ranks along mesh dim ``dim`` through ``coord`` of ``grid``, in mesh order."""
    index = list(coord)
    index[dim] = slice(None)
    return [int(r) for r in grid[tuple(index)]]


def _check_mesh(mesh, grid, names, rank, root=None):
    """Metadata of ``mesh`` against the expected rank ``grid``; every group really communicates
    among exactly the expected ranks, in mesh order."""
    from hyper_parallel.platform import get_platform

    platform = get_platform()
    grid = np.asarray(grid)
    where = np.argwhere(grid == rank)
    assert len(where) == 1, f"rank {rank} not in {grid.tolist()}"
    coord = tuple(int(c) for c in where[0])
    what = f"{mesh!r} (rank {rank})"
    assert mesh.ndim == grid.ndim, what
    assert mesh.shape == mesh.mesh_shape == tuple(grid.shape), what
    assert mesh.mesh.tolist() == grid.tolist(), what
    assert mesh.rank_list == tuple(int(r) for r in grid.reshape(-1)), what
    assert mesh.mesh_dim_names == (tuple(names) if names is not None else None), what
    assert mesh.device_type == "cpu", what
    assert mesh.size() == grid.size, what
    assert mesh.get_coordinate() == coord, what
    if root is None:
        assert mesh.root_mesh is None, what
    else:
        assert mesh.root_mesh is root, what
    for d in range(grid.ndim):
        keys = [d, d - grid.ndim] + ([names[d]] if names else [])
        for key in keys:
            assert mesh.size(key) == grid.shape[d], (what, key)
            assert mesh.get_local_rank(key) == coord[d], (what, key)
            assert mesh.get_group(key) is mesh.get_group(d), (what, key)
        expected = _line(grid, coord, d)
        assert mesh.group_ranks(d) == tuple(expected), what
        group = mesh.get_group(d)
        total = np_of(platform.all_reduce(t(np.array([rank], np.int64)), group, "sum"))
        assert total.item() == sum(expected), (what, d, total.item(), expected)
        gathered = np_of(platform.all_gather(t(np.array([rank], np.int64)), group, 0))
        assert gathered.tolist() == expected, (what, d, gathered.tolist(), expected)
    if grid.ndim == 1:
        assert mesh.get_group() is mesh.get_group(0)
        assert mesh.get_local_rank() == coord[0]
    else:
        expect_error(ValueError, lambda: mesh.get_group())
    return coord


def _check_errors_init(world_size):
    from hyper_parallel.core.dtensor import init_device_mesh
    for bad in [(world_size - 1,), (world_size + 1,), (world_size, 2), (3, 3)]:
        expect_error(ValueError, lambda: init_device_mesh("cpu", bad), "world")
    expect_error(ValueError, lambda: init_device_mesh("cpu", (world_size,), mesh_dim_names=("a", "b")))
    expect_error(ValueError, lambda: init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("a", "a")))


def _check_current_mesh(mesh, sub):
    from hyper_parallel.core.dtensor import current_mesh
    assert current_mesh() is None
    with mesh as entered:
        assert entered is mesh
        assert current_mesh() is mesh
        with sub:
            assert current_mesh() is sub
        assert current_mesh() is mesh
    assert current_mesh() is None

    def fail_inside():
        with mesh:
            raise RuntimeError("boom")
    expect_error(RuntimeError, fail_inside, "boom")
    assert current_mesh() is None  # popped on an exception too


# ============================================================================ world 4
def world4(rank, world_size):
    from hyper_parallel.core.dtensor import DeviceMesh, init_device_mesh

    _check_errors_init(world_size)
    grid = np.arange(4).reshape(2, 2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_i, tp_i = _check_mesh(mesh, grid, ("dp", "tp"), rank)
    assert (dp_i, tp_i) == (rank // 2, rank % 2)
    expect_error(KeyError, lambda: mesh.get_group("pp"))
    expect_error(KeyError, lambda: mesh["pp"])
    expect_error(IndexError, lambda: mesh.size(2))

    # ---- slicing
    tp = mesh["tp"]
    _check_mesh(tp, grid[dp_i, :], ("tp",), rank, root=mesh)
    dp = mesh["dp"]
    _check_mesh(dp, grid[:, tp_i], ("dp",), rank, root=mesh)
    assert mesh[("tp",)] == tp
    same = mesh[("dp", "tp")]
    assert same == mesh and same.rank_list == mesh.rank_list
    rev = mesh[("tp", "dp")]
    _check_mesh(rev, grid.T, ("tp", "dp"), rank, root=mesh)
    assert rev != mesh  # same ranks, other layout
    # a slice of a slice still has the original root
    _check_mesh(rev["dp"], grid[:, tp_i], ("dp",), rank, root=mesh)

    # ---- flatten (registered on the root) and _unflatten
    flat = mesh.flatten("dp_tp")
    _check_mesh(flat, np.arange(4), ("dp_tp",), rank, root=mesh)
    assert mesh["dp_tp"] is flat
    assert tp["dp_tp"] is flat  # looked up through the root from any slice
    assert mesh.flatten() is flat  # default name joins the dim names
    rflat = rev.flatten("tp_dp")  # a column-major flattening: ranks not ascending
    _check_mesh(rflat, grid.T.reshape(-1), ("tp_dp",), rank, root=mesh)
    assert mesh["tp_dp"] is rflat
    unflat = flat._unflatten("dp_tp", (2, 2), ("a", "b"))
    _check_mesh(unflat, grid, ("a", "b"), rank)
    unflat4 = flat._unflatten("dp_tp", (4, 1), ("x", "y"))
    _check_mesh(unflat4, np.arange(4).reshape(4, 1), ("x", "y"), rank)
    expect_error(ValueError, lambda: flat._unflatten("dp_tp", (3, 2), ("a", "b")))
    expect_error(ValueError, lambda: flat._unflatten("dp_tp", (2, 2), ("a",)))

    # ---- concatenate: ordered by the root's dims whatever the argument order
    cat = DeviceMesh.concatenate([tp, dp])
    _check_mesh(cat, grid, ("dp", "tp"), rank, root=mesh)
    assert cat == mesh
    expect_error(ValueError, lambda: DeviceMesh.concatenate([tp, tp]))  # repeated name
    expect_error(ValueError, lambda: DeviceMesh.concatenate([flat, tp]))  # overlapping root dims
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expect_error(ValueError, lambda: DeviceMesh.concatenate([dp, other["tp"]]))  # different roots

    # ---- identity
    assert mesh.to_hash() == ((2, 2), ("dp", "tp"), (0, 1, 2, 3))
    assert other == mesh and hash(other) == hash(mesh) and other is not mesh
    assert tp.to_hash() == ((2,), ("tp",), tuple(int(r) for r in grid[dp_i]))
    direct = DeviceMesh("cpu", grid[dp_i].tolist(), mesh_dim_names=("tp",))
    assert direct == tp and hash(direct) == hash(tp)
    assert DeviceMesh("cpu", grid[dp_i].tolist()) != tp  # names are part of the identity
    assert mesh != flat
    assert len({mesh, other, tp, direct, flat}) == 3

    # ---- a directly built mesh whose lines are not in ascending rank order
    desc = DeviceMesh("cpu", [3, 2, 1, 0], mesh_dim_names=("r",))
    _check_mesh(desc, np.array([3, 2, 1, 0]), ("r",), rank)
    expect_error(ValueError, lambda: DeviceMesh("cpu", [0, 0, 1, 2]))  # a rank twice

    _check_current_mesh(mesh, tp)
    return mesh.get_coordinate()



# ============================================================================ world 8
def world8(rank, world_size):
    from hyper_parallel.core.dtensor import DeviceMesh, init_device_mesh

    _check_errors_init(world_size)
    names = ("pp", "dp", "tp")
    grid = np.arange(8).reshape(2, 2, 2)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
    coord = _check_mesh(mesh, grid, names, rank)
    assert coord == (rank // 4, rank // 2 % 2, rank % 2)
    p, d, t = coord

    # ---- every single dim, every pair (including non-adjacent and reversed), all three permuted
    for n in names:
        i = names.index(n)
        index = list(coord)
        index[i] = slice(None)
        _check_mesh(mesh[n], grid[tuple(index)], (n,), rank, root=mesh)
    _check_mesh(mesh[("dp", "tp")], grid[p], ("dp", "tp"), rank, root=mesh)
    _check_mesh(mesh[("pp", "tp")], grid[:, d, :], ("pp", "tp"), rank, root=mesh)
    _check_mesh(mesh[("pp", "dp")], grid[:, :, t], ("pp", "dp"), rank, root=mesh)
    _check_mesh(mesh[("tp", "pp")], grid[:, d, :].T, ("tp", "pp"), rank, root=mesh)
    _check_mesh(mesh[("tp", "dp", "pp")], grid.transpose(2, 1, 0), ("tp", "dp", "pp"), rank, root=mesh)
    assert mesh[names] is mesh

    # ---- flatten: contiguous and non-contiguous dims; lookup through the root
    dp_tp = mesh[("dp", "tp")].flatten()
    assert dp_tp.mesh_dim_names == ("dp_tp",)
    _check_mesh(dp_tp, grid[p].reshape(-1), ("dp_tp",), rank, root=mesh)
    assert mesh["dp_tp"] is dp_tp
    pp_tp = mesh[("pp", "tp")].flatten("pp_tp")
    _check_mesh(pp_tp, grid[:, d, :].reshape(-1), ("pp_tp",), rank, root=mesh)
    assert mesh["tp"]["pp_tp"] is pp_tp
    world = mesh.flatten("world")
    _check_mesh(world, np.arange(8), ("world",), rank, root=mesh)

    # ---- _unflatten
    un = dp_tp._unflatten("dp_tp", (2, 2), ("d2", "t2"))
    _check_mesh(un, grid[p], ("d2", "t2"), rank)
    flat2 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "x"))
    _check_mesh(flat2, np.arange(8).reshape(2, 4), ("dp", "x"), rank)
    three = flat2._unflatten("x", (2, 2), ("cp", "tp"))
    _check_mesh(three, grid, ("dp", "cp", "tp"), rank)
    _check_mesh(three["cp"], grid[p, :, t], ("cp",), rank, root=three)
    un_world = world._unflatten("world", (4, 2), ("a", "b"))
    _check_mesh(un_world, np.arange(8).reshape(4, 2), ("a", "b"), rank)

    # ---- concatenate
    cat = DeviceMesh.concatenate([mesh["tp"], mesh["pp"]])
    _check_mesh(cat, grid[:, d, :], ("pp", "tp"), rank, root=mesh)
    assert cat == mesh[("pp", "tp")]
    cat3 = DeviceMesh.concatenate([mesh["tp"], mesh["pp"], mesh["dp"]])
    _check_mesh(cat3, grid, names, rank, root=mesh)
    assert cat3 == mesh
    catf = DeviceMesh.concatenate([dp_tp, mesh["pp"]])
    _check_mesh(catf, grid.reshape(2, 4), ("pp", "dp_tp"), rank, root=mesh)
    expect_error(ValueError, lambda: DeviceMesh.concatenate([dp_tp, mesh["tp"]]))  # dp_tp already holds tp
    expect_error(ValueError, lambda: DeviceMesh.concatenate([mesh["dp"], mesh["dp"]]))
    expect_error(ValueError, lambda: DeviceMesh.concatenate([mesh["dp"], three["tp"]]))

    # ---- identity
    assert mesh.to_hash() == ((2, 2, 2), names, tuple(range(8)))
    assert mesh["tp"].to_hash() == ((2,), ("tp",), tuple(int(r) for r in grid[p, d]))
    assert three != mesh  # other names
    _check_current_mesh(mesh, mesh["dp"])
    return coord



