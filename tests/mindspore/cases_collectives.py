"""Every raw and every differentiable collective of the MindSpore platform vs a numpy reference.

Each rank builds every rank's input deterministically (``inp``), so it computes the expected
result -- and, for the differentiable collectives, the gradient of the SUM over ranks of
``sum(out_r * w_r)`` -- locally with numpy. Checks run on the world group, on the world in reverse
order (a mesh line [n-1, ..., 0]) and on disjoint sub-groups; with odd shapes, non-contiguous
inputs, every reduce op, several dtypes and the async paths.
"""
import numpy as np

from tests.mindspore.common import call, close, grad_of, inp, t

REDUCE_OPS = ("sum", "avg", "max", "min")


def groups_for(world_size):
    """Rank tuples to test on, in the order every rank creates them."""
    extra = {2: [(1, 0), (0,), (1,)], 4: [(3, 2, 1, 0), (1, 3), (2, 0)]}
    return [tuple(range(world_size))] + extra.get(world_size, [])


def _my_groups(platform, rank, world_size):
    mine = []
    for ranks in groups_for(world_size):
        group = platform.new_group(ranks)
        if rank in ranks:
            mine.append((ranks, group))
    return mine


def _reduce(stacked, op):
    return {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.max(0), "min": stacked.min(0)}[op]


def _noncontig(array):
    """A MindSpore view with ``array``'s values that is not contiguous (a transposed copy)."""
    import mindspore as ms
    if array.ndim >= 2:
        view = ms.Tensor(np.ascontiguousarray(np.swapaxes(array, 0, 1))).swapaxes(0, 1)
        assert not view.is_contiguous()
        return view
    return ms.Tensor(array)


# =============================================================================== raw collectives
def raw_collectives(rank, world_size):
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    checked = 0
    for ranks, group in _my_groups(platform, rank, world_size):
        n = len(ranks)
        me = ranks.index(rank)
        assert platform.group_ranks(group) == ranks
        assert platform.get_rank(group) == me and platform.get_world_size(group) == n
        tag = f"{ranks}"
        for async_op in (False, True):
            # ---- all_gather: dims, non-contiguous, odd shapes, dtypes, 0-dim
            for dim, shape in ((0, (3, 5)), (1, (2, 3, 4)), (-1, (2, 5))):
                mine = inp(f"ag{tag}{dim}", rank, shape)
                out = call(platform.all_gather, _noncontig(mine), group, dim=dim, async_op=async_op)
                close(out, np.concatenate([inp(f"ag{tag}{dim}", r, shape) for r in ranks], axis=dim),
                      f"all_gather {ranks} dim={dim}")
            for dtype in (np.float16, np.float64, np.int32, np.int64, np.bool_):
                mine = (inp(f"agd{tag}", rank, (2, 3)) * 10).astype(dtype)
                out = call(platform.all_gather, t(mine), group, dim=0, async_op=async_op)
                expected = np.concatenate([(inp(f"agd{tag}", r, (2, 3)) * 10).astype(dtype) for r in ranks])
                assert out.asnumpy().dtype == expected.dtype, (out.dtype, expected.dtype)
                close(out, expected, f"all_gather {ranks} {np.dtype(dtype).name}")
            scalar = call(platform.all_gather, t(np.float32(rank)), group, async_op=async_op)
            close(scalar, np.array(ranks, np.float32), "all_gather 0-dim")
            # ---- all_reduce: every op; float64 (emulated), int32, 0-dim
            for op in REDUCE_OPS:
                mine = inp(f"ar{tag}{op}", rank, (3, 4))
                out = call(platform.all_reduce, _noncontig(mine), group, op=op, async_op=async_op)
                close(out, _reduce(np.stack([inp(f"ar{tag}{op}", r, (3, 4)) for r in ranks]), op),
                      f"all_reduce {ranks} {op}")
            for dtype in (np.float64, np.int32):
                for op in ("sum", "max"):
                    mine = (inp(f"ard{tag}", rank, (5,)) * 100).astype(dtype)
                    out = call(platform.all_reduce, t(mine), group, op=op, async_op=async_op)
                    expected = _reduce(np.stack([(inp(f"ard{tag}", r, (5,)) * 100).astype(dtype)
                                                 for r in ranks]), op)
                    close(out, expected.astype(dtype), f"all_reduce {ranks} {np.dtype(dtype).name} {op}")
            out = call(platform.all_reduce, t(np.float32(rank + 1)), group, async_op=async_op)
            close(out, np.float32(sum(r + 1 for r in ranks)), "all_reduce 0-dim")
            # the input is not modified
            mine = inp(f"arin{tag}", rank, (4,))
            x = t(mine)
            call(platform.all_reduce, x, group, async_op=async_op)
            close(x, mine, "all_reduce leaves its input alone")
            # ---- broadcast from every source
            for src in ranks:
                mine = inp(f"bc{tag}{src}", rank, (2, 3))
                out = call(platform.broadcast, _noncontig(mine), src, group, async_op=async_op)
                close(out, inp(f"bc{tag}{src}", src, (2, 3)), f"broadcast {ranks} from {src}")
            out = call(platform.broadcast, t(np.array([rank % 2 == 0, True])), ranks[-1], group,
                       async_op=async_op)
            close(out, np.array([ranks[-1] % 2 == 0, True]), "broadcast bool")
            # ---- all_to_all_single: every split/concat pair, non-contiguous
            for split_dim, concat_dim in ((0, 0), (1, 0), (0, 2), (2, 1)):
                shape = [2, 3, 2]
                shape[split_dim] *= n
                arrays = [inp(f"a2a{tag}{split_dim}{concat_dim}", r, shape) for r in ranks]
                out = call(platform.all_to_all_single, _noncontig(arrays[me]), group,
                           split_dim=split_dim, concat_dim=concat_dim, async_op=async_op)
                expected = np.concatenate([np.split(a, n, axis=split_dim)[me] for a in arrays],
                                          axis=concat_dim)
                close(out, expected, f"all_to_all_single {ranks} split={split_dim} concat={concat_dim}")
            # ---- all_to_all (list), uneven pieces: rank r sends (r + j + 1, 2) to group rank j
            sends = [inp(f"a2al{tag}{j}", rank, (me + j + 1, 2)) for j in range(n)]
            out_shapes = [(j + me + 1, 2) for j in range(n)]
            out = call(platform.all_to_all, [t(s) for s in sends], group, out_shapes=out_shapes,
                       async_op=async_op)
            assert len(out) == n
            for j, src in enumerate(ranks):
                close(out[j], inp(f"a2al{tag}{me}", src, (j + me + 1, 2)), f"all_to_all list from {src}")
            # ---- reduce_scatter: every op, dims
            for op in REDUCE_OPS:
                for dim in (0, 1):
                    shape = [3, 2]
                    shape[dim] *= n
                    arrays = [inp(f"rs{tag}{op}{dim}", r, shape) for r in ranks]
                    out = call(platform.reduce_scatter, _noncontig(arrays[me]), group, dim=dim, op=op,
                               async_op=async_op)
                    close(out, np.split(_reduce(np.stack(arrays), op), n, axis=dim)[me],
                          f"reduce_scatter {ranks} {op} dim={dim}")
            # ---- p2p: a ring shift, a pair swap, several tensors at once, silent ranks
            nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
            mine = inp(f"p2p{tag}", rank, (3, 2))
            (got,) = call(platform.p2p_exchange, [(t(mine), nxt)], [(t(mine), prv)], group,
                          async_op=async_op)
            close(got, inp(f"p2p{tag}", prv, (3, 2)), f"p2p ring {ranks}")
            # group rank 0 sends two tensors to the last group rank; the others only take part
            a, b = inp(f"p2pa{tag}", rank, (2, 2)), inp(f"p2pb{tag}", rank, (4,))
            last = ranks[-1]
            sends = [(t(a), last), (t(b), last)] if me == 0 else []
            recvs = [(t(a), ranks[0]), (t(b), ranks[0])] if rank == last else []
            got = call(platform.p2p_exchange, sends, recvs, group, async_op=async_op)
            assert len(got) == len(recvs)
            if recvs:
                close(got[0], inp(f"p2pa{tag}", ranks[0], (2, 2)), "p2p first of two")
                close(got[1], inp(f"p2pb{tag}", ranks[0], (4,)), "p2p second of two")
            checked += 1
    return checked


# =============================================================================== accounting
def bytes_and_capabilities(rank, world_size):
    """Emulated collectives report the bytes they really send, under the logical op's name."""
    from hyper_parallel.core.comm_mode import CommDebugMode
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    caps = platform.capabilities()
    assert caps["backend"] == "mccl"
    for op in ("all_to_all_single", "reduce_scatter", "p2p (batch_isend_irecv)"):
        assert caps[op].startswith("emulated"), (op, caps[op])
    group = platform.new_group(range(world_size))
    n = world_size
    x = t(inp("bytes", rank, (4 * n, 3)))
    nbytes = 4 * n * 3 * 4
    with CommDebugMode() as comm:
        platform.all_gather(x, group)
        platform.all_reduce(x, group)
        platform.all_to_all_single(x, group)
        platform.reduce_scatter(x, group)
    expected_counts = {"all_gather": 1, "all_reduce": 1, "all_to_all": 1, "reduce_scatter": 1}
    assert comm.get_comm_counts() == expected_counts, comm.get_comm_counts()
    expected = {"all_gather": (n - 1) * nbytes, "all_reduce": 2 * nbytes * (n - 1) // n,
                "all_to_all": (n - 1) * nbytes, "reduce_scatter": 2 * nbytes * (n - 1) // n}
    assert comm.get_comm_bytes() == expected, (comm.get_comm_bytes(), expected)
    with CommDebugMode() as comm:
        platform.p2p_exchange([(x, (rank + 1) % n)], [(x, (rank - 1) % n)])
    # the size table (int64 n x 1 per rank) plus the padded payload, both all-gathered, plus one
    # 4-byte max all-reduce
    assert comm.get_comm_bytes()["send_recv"] == (n - 1) * (n * 8 + nbytes), comm.get_comm_bytes()
    return caps


# =============================================================================== differentiable
def differentiable_collectives(rank, world_size):
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    checked = 0
    for ranks, group in _my_groups(platform, rank, world_size):
        n = len(ranks)
        me = ranks.index(rank)
        tag = f"{ranks}"

        def weights(name, shape):
            return [inp(f"w{name}{tag}", r, shape) for r in ranks]

        def grad(collective, x, w):
            """d/dx of sum(collective(x) * w) (the sum over ranks of these losses)."""
            return grad_of(lambda a: (collective(a) * t(w)).sum(), t(x))[0]

        # all_gather(dim=1): out = cat_j x_j; dL/dx_me = sum_j w_j[block me]
        xs = [inp(f"dag{tag}", r, (2, 3)) for r in ranks]
        ws = weights("ag", (2, 3 * n))
        out = platform.differentiable_all_gather(t(xs[me]), group, 1)
        close(out, np.concatenate(xs, 1), "differentiable all_gather forward")
        g = grad(lambda a: platform.differentiable_all_gather(a, group, 1), xs[me], ws[me])
        close(g, sum(np.split(w, n, 1)[me] for w in ws), f"all_gather backward {ranks}")
        # reduce_scatter(dim=0): out_me = sum_j x_j[block me]; dL/dx[block b] = w_b
        xs = [inp(f"drs{tag}", r, (2 * n, 3)) for r in ranks]
        ws = weights("rs", (2, 3))
        g = grad(lambda a: platform.differentiable_reduce_scatter(a, group, 0), xs[me], ws[me])
        close(g, np.concatenate(ws, 0), f"reduce_scatter backward {ranks}")
        # all_to_all(split 1, concat 0): the gradient is the inverse all-to-all of the weights
        xs = [inp(f"da2a{tag}", r, (2, 3 * n)) for r in ranks]
        ws = weights("a2a", (2 * n, 3))
        out = platform.differentiable_all_to_all(t(xs[me]), group, 1, 0)
        close(out, np.concatenate([np.split(x, n, 1)[me] for x in xs], 0),
              "differentiable all_to_all forward")
        g = grad(lambda a: platform.differentiable_all_to_all(a, group, 1, 0), xs[me], ws[me])
        close(g, np.concatenate([np.split(w, n, 0)[me] for w in ws], 1), f"all_to_all backward {ranks}")
        # all_reduce: sum (backward sum / identity), avg, max
        xs = [inp(f"dar{tag}", r, (3,)) for r in ranks]
        ws = weights("ar", (3,))
        g = grad(lambda a: platform.differentiable_all_reduce(a, group, "sum"), xs[me], ws[me])
        close(g, sum(ws), "all_reduce(sum) backward")
        g = grad(lambda a: platform.differentiable_all_reduce(a, group, "sum", backward="identity"),
                 xs[me], ws[me])
        close(g, ws[me], "all_reduce(sum, identity) backward")
        g = grad(lambda a: platform.differentiable_all_reduce(a, group, "avg"), xs[me], ws[me])
        close(g, sum(ws) / n, "all_reduce(avg) backward")
        stacked = np.stack(xs)
        winner = stacked.argmax(0)
        g = grad(lambda a: platform.differentiable_all_reduce(a, group, "max"), xs[me], ws[me])
        close(g, np.where(winner == me, sum(ws), 0.0), "all_reduce(max) backward")
        # p2p ring shift: out_me = x_prev; dL/dx_me = w_next
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        xs = [inp(f"dp2p{tag}", r, (2, 2)) for r in ranks]
        ws = weights("p2p", (2, 2))
        out = platform.differentiable_p2p_exchange(t(xs[me]), nxt, prv, group)
        close(out, xs[(me - 1) % n], "differentiable p2p forward")
        g = grad(lambda a: platform.differentiable_p2p_exchange(a, nxt, prv, group), xs[me], ws[me])
        close(g, ws[(me + 1) % n], f"p2p backward {ranks}")
        checked += 1
    return checked
