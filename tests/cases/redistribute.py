"""Redistribution cases on any framework: the collective(s) each plan uses, their bytes, plan
caching, and the cheaper of two orders of the same collectives."""
import numpy as np

from tests.frameworks import close, t


def _counts(fn):
    from hyper_parallel.core.comm_mode import CommDebugMode
    with CommDebugMode() as comm:
        result = fn()
    return comm.get_comm_counts(), comm.get_comm_bytes(), result


def collectives_per_plan(rank, world_size, check_bytes=True):
    """Each redistribution is the planned collective(s) -- counted -- and, where the platform's
    collectives are native (``check_bytes``), exactly their bytes; plans are cached."""
    from hyper_parallel.core.dtensor import DTensor, Partial, Replicate, Shard, StridedShard, init_device_mesh
    from hyper_parallel.core.dtensor.redistribute import _plan

    S0, S1, R = Shard(0), Shard(1), Replicate()
    P = Partial()
    f32 = 4

    def make(mesh, shape, placements, partial_value=None):
        full = np.arange(float(np.prod(shape)), dtype=np.float32).reshape(shape)
        dt = DTensor.from_local(t(full), mesh, [R] * mesh.ndim)
        if any(p.is_partial() for p in placements):
            # Partial(sum) pieces: each rank holds a 1/n share; avg/max pieces: the value itself
            n = 1
            for m, p in enumerate(placements):
                if p.is_partial() and p.reduce_op == "sum":
                    n *= mesh.size(m)
            base = [R if p.is_partial() else p for p in placements]
            local = dt.redistribute(mesh, base).to_local() / n
            return DTensor.from_local(local, mesh, placements, shape=shape), full
        return dt.redistribute(mesh, placements), full

    def check(mesh, shape, src, dst, want_counts, want_bytes=None):
        dt, full = make(mesh, shape, src)
        counts, nbytes, res = _counts(lambda: dt.redistribute(mesh, dst))
        assert counts == want_counts, (src, dst, counts, want_counts)
        if want_bytes is not None and check_bytes:
            assert nbytes == want_bytes, (src, dst, nbytes, want_bytes)
        close(res.full_tensor(), full, f"{src} -> {dst} {shape}")
        return dt

    # ---- 1-D mesh of 4
    mesh = init_device_mesh("cpu", (4,))
    local_bytes = 2 * 12 * f32  # (8, 12) split in 4 along dim 0
    check(mesh, (8, 12), [S0], [S1], {"all_to_all": 1}, {"all_to_all": local_bytes * 3 // 4})
    check(mesh, (8, 12), [S1], [S0], {"all_to_all": 1}, {"all_to_all": local_bytes * 3 // 4})
    check(mesh, (8, 12), [S0], [R], {"all_gather": 1}, {"all_gather": 3 * local_bytes})
    check(mesh, (8, 12), [P], [R], {"all_reduce": 1}, {"all_reduce": 2 * 3 * 8 * 12 * f32 // 4})
    check(mesh, (8, 12), [P], [S0], {"reduce_scatter": 1}, {"reduce_scatter": 3 * 8 * 12 * f32 // 4})
    check(mesh, (8, 12), [P], [S1], {"reduce_scatter": 1})
    check(mesh, (8, 12), [Partial("max")], [R], {"all_reduce": 1})
    check(mesh, (8, 12), [Partial("avg")], [S0], {"reduce_scatter": 1})
    check(mesh, (8, 12), [R], [S0], {})
    check(mesh, (8, 12), [R], [S1], {})
    check(mesh, (8, 12), [R], [P], {})
    check(mesh, (8, 12), [R], [Partial("avg")], {})
    check(mesh, (7, 5), [S0], [S1], {"all_to_all": 1})  # uneven: still one collective
    check(mesh, (7, 5), [S1], [S0], {"all_to_all": 1})
    check(mesh, (7, 5), [S0], [R], {"all_gather": 1})
    check(mesh, (7, 5), [P], [S1], {"reduce_scatter": 1})

    # ---- 2-D mesh 2x2
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # (8, 12) as (R, S(0)): local (4, 12); the tp all-to-all sends half of it
    check(mesh2, (8, 12), [R, S0], [R, S1], {"all_to_all": 1}, {"all_to_all": 4 * 12 * f32 // 2})
    check(mesh2, (8, 12), [S0, R], [S1, R], {"all_to_all": 1})
    check(mesh2, (8, 12), [R, S0], [S0, S1], {"all_to_all": 1})
    check(mesh2, (8, 12), [S0, P], [S0, S1], {"reduce_scatter": 1})
    check(mesh2, (8, 12), [P, P], [S0, S1], {"reduce_scatter": 2})
    check(mesh2, (8, 12), [P, P], [R, R], {"all_reduce": 2})
    check(mesh2, (8, 12), [R, R], [S0, S1], {})
    check(mesh2, (8, 12), [R, R], [P, S1], {})
    check(mesh2, (8, 12), [S0, S0], [R, R], {"all_gather": 2})
    # uneven nested shards: each mesh dim moves by one all-to-all (innermost first)
    check(mesh2, (7, 5), [S0, S0], [StridedShard(1, 2), S1], {"all_to_all": 2})
    check(mesh2, (7, 5), [StridedShard(1, 2), S1], [S0, S0], {"all_to_all": 2})

    # ---- 3-D mesh 2x2x2 on 8 ranks is covered by the property test; here: plan caching
    dt, _ = make(mesh, (8, 12), [S0])
    dt.redistribute(mesh, [S1])
    before = _plan.cache_info()
    counts, _, res = _counts(lambda: dt.redistribute(mesh, [S1]))
    after = _plan.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses, (before, after)
    assert counts == {"all_to_all": 1}
    # another shape is another plan
    dt2, _ = make(mesh, (8, 16), [S0])
    before = _plan.cache_info()
    dt2.redistribute(mesh, [S1])
    after = _plan.cache_info()
    assert after.misses == before.misses + 1, (before, after)
    # an identical request is a no-op: no plan, no communication
    counts, _, same = _counts(lambda: dt.redistribute(mesh, [S0]))
    assert counts == {} and same is dt
    return True


def fewest_bytes(rank, world_size):
    """Cheaper orders of the same collectives: slice before reducing, reduce before gathering
    (native collectives: exact bytes)."""
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.core.dtensor import DTensor, Partial, Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    full = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    f32 = 4
    problems = []
    # (P, R) -> (S(0), S(1)): slice dim 1 locally first, then reduce-scatter a (8, 4) tensor
    dt = DTensor.from_local(t(full / 2), mesh, [Partial(), Replicate()])
    with CommDebugMode() as comm:
        res = dt.redistribute(mesh, [Shard(0), Shard(1)])
    close(res.full_tensor(), full, "fewest bytes")
    if comm.get_comm_bytes() != {"reduce_scatter": 8 * 4 * f32 // 2}:
        problems.append(f"(P, R) -> (S(0), S(1)): {comm.get_comm_bytes()}")
    # (S(0), P) -> (R, R): all-reduce the (4, 8) shard, then all-gather
    local = np.split(full, 2)[mesh.get_coordinate()[0]] / 2
    dt = DTensor.from_local(t(local), mesh, [Shard(0), Partial()])
    with CommDebugMode() as comm:
        res = dt.redistribute(mesh, [Replicate(), Replicate()])
    close(res.full_tensor(), full, "fewest bytes")
    want = {"all_reduce": 2 * 4 * 8 * f32 // 2, "all_gather": 4 * 8 * f32}
    if comm.get_comm_bytes() != want:
        problems.append(f"(S(0), P) -> (R, R): {comm.get_comm_bytes()} != {want}")
    return problems
