"""Every raw and every differentiable collective of the platform vs a numpy reference, on any
framework.

Each rank builds every rank's input deterministically (``inp``), so it computes the expected result
-- and, for the differentiable collectives, the gradient of the SUM over ranks of
``sum(out_r * w_r)`` -- locally with numpy. Checks run on the world group, on the world in reverse
order (a mesh line [n-1, ..., 0]) and on disjoint sub-groups (odd sizes where the world allows);
with odd shapes, non-contiguous inputs, every reduce op, several dtypes and the async paths.
"""
import numpy as np

from tests.frameworks import call, close, current, expect_error, grad_of, inp, t

REDUCE_OPS = ("sum", "avg", "max", "min")


def groups_for(world_size):
    """Rank tuples to test on, in the order every rank creates them."""
    extra = {2: [(1, 0), (0,), (1,)], 4: [(3, 2, 1, 0), (1, 3), (2, 0)],
             8: [(2, 5, 7), (0, 1, 3, 4, 6)]}
    return [tuple(range(world_size))] + extra.get(world_size, [])


def my_groups(platform, rank, world_size):
    """(ranks, group) for each group this rank belongs to; every rank creates every group."""
    mine = []
    for ranks in groups_for(world_size):
        group = platform.new_group(ranks)
        if rank in ranks:
            mine.append((ranks, group))
    return mine


def _reduce(stacked, op):
    return {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.max(0), "min": stacked.min(0)}[op]


def _nc(array):
    return current().noncontiguous(array)


# =============================================================================== raw collectives
def _all_gather(platform, ranks, group, rank, async_op):
    tag = f"{ranks}"
    for dim, shape in ((0, (3, 5)), (1, (2, 3, 4)), (2, (2, 3, 4)), (-1, (2, 5))):
        out = call(platform.all_gather, _nc(inp(f"ag{tag}{dim}", rank, shape)), group, dim=dim,
                   async_op=async_op)
        close(out, np.concatenate([inp(f"ag{tag}{dim}", r, shape) for r in ranks], axis=dim),
              f"all_gather {ranks} dim={dim}")
        assert out.is_contiguous(), f"all_gather {ranks} dim={dim}: non-contiguous output"
    for dtype in (np.float16, np.float64, np.int32, np.int64, np.bool_):
        def value(r):
            return (inp(f"agd{tag}", r, (2, 3)) * 10).astype(dtype)
        out = call(platform.all_gather, t(value(rank)), group, dim=0, async_op=async_op)
        expected = np.concatenate([value(r) for r in ranks])
        assert current().numpy(out).dtype == expected.dtype, (out.dtype, expected.dtype)
        close(out, expected, f"all_gather {ranks} {np.dtype(dtype).name}")
    scalar = call(platform.all_gather, t(np.float32(rank)), group, async_op=async_op)
    close(scalar, np.array(ranks, np.float32), "all_gather 0-dim")


def _all_reduce(platform, ranks, group, rank, async_op):
    tag = f"{ranks}"
    for op in REDUCE_OPS:
        mine = inp(f"ar{tag}{op}", rank, (3, 4))
        x = _nc(mine)
        out = call(platform.all_reduce, x, group, op=op, async_op=async_op)
        close(out, _reduce(np.stack([inp(f"ar{tag}{op}", r, (3, 4)) for r in ranks]), op),
              f"all_reduce {ranks} {op}")
        close(x, mine, "all_reduce leaves its input alone")
    for dtype in (np.float64, np.int32):
        for op in ("sum", "max"):
            def value(r):
                return (inp(f"ard{tag}", r, (5,)) * 100).astype(dtype)
            out = call(platform.all_reduce, t(value(rank)), group, op=op, async_op=async_op)
            expected = _reduce(np.stack([value(r) for r in ranks]), op).astype(dtype)
            close(out, expected, f"all_reduce {ranks} {np.dtype(dtype).name} {op}")
    out = call(platform.all_reduce, t(np.float32(rank + 1)), group, async_op=async_op)
    close(out, np.float32(sum(r + 1 for r in ranks)), "all_reduce 0-dim")


def _broadcast(platform, ranks, group, rank, async_op):
    tag = f"{ranks}"
    for src in ranks:
        out = call(platform.broadcast, _nc(inp(f"bc{tag}{src}", rank, (2, 3))), src, group, async_op=async_op)
        close(out, inp(f"bc{tag}{src}", src, (2, 3)), f"broadcast {ranks} from {src}")
    out = call(platform.broadcast, t(np.array([rank % 2 == 0, True])), ranks[-1], group, async_op=async_op)
    close(out, np.array([ranks[-1] % 2 == 0, True]), "broadcast bool")


def _all_to_all(platform, ranks, group, rank, async_op):
    tag, n, me = f"{ranks}", len(ranks), ranks.index(rank)
    for split_dim, concat_dim in ((0, 0), (1, 0), (0, 2), (2, 1), (-1, 0), (-2, -3)):
        shape = [2, 3, 2]
        shape[split_dim] *= n
        arrays = [inp(f"a2a{tag}{split_dim}{concat_dim}", r, shape) for r in ranks]
        out = call(platform.all_to_all_single, _nc(arrays[me]), group, split_dim=split_dim,
                   concat_dim=concat_dim, async_op=async_op)
        expected = np.concatenate([np.split(a, n, axis=split_dim)[me] for a in arrays], axis=concat_dim)
        close(out, expected, f"all_to_all_single {ranks} split={split_dim} concat={concat_dim}")
        assert out.is_contiguous(), "all_to_all_single: non-contiguous output"
    # list form, uneven pieces: rank r sends (r + j + 1, 2) to group rank j
    sends = [inp(f"a2al{tag}{j}", rank, (me + j + 1, 2)) for j in range(n)]
    out = call(platform.all_to_all, [t(s) for s in sends], group, out_shapes=[(j + me + 1, 2) for j in range(n)],
               async_op=async_op)
    assert len(out) == n
    for j, src in enumerate(ranks):
        close(out[j], inp(f"a2al{tag}{me}", src, (j + me + 1, 2)), f"all_to_all list from {src}")


def _reduce_scatter(platform, ranks, group, rank, async_op):
    tag, n, me = f"{ranks}", len(ranks), ranks.index(rank)
    for op in REDUCE_OPS:
        for dim in (0, 1, -1):
            shape = [3, 2]
            shape[dim] *= n
            arrays = [inp(f"rs{tag}{op}{dim}", r, shape) for r in ranks]
            out = call(platform.reduce_scatter, _nc(arrays[me]), group, dim=dim, op=op, async_op=async_op)
            close(out, np.split(_reduce(np.stack(arrays), op), n, axis=dim)[me],
                  f"reduce_scatter {ranks} {op} dim={dim}")


def _p2p(platform, ranks, group, rank, async_op):
    tag, n, me = f"{ranks}", len(ranks), ranks.index(rank)
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    mine = inp(f"p2p{tag}", rank, (3, 2))
    (got,) = call(platform.p2p_exchange, [(_nc(mine), nxt)], [(t(mine), prv)], group, async_op=async_op)
    close(got, inp(f"p2p{tag}", prv, (3, 2)), f"p2p ring {ranks}")
    # both ring directions at once
    other = inp(f"p2pb{tag}", rank, (2, 5))
    got_a, got_b = platform.p2p_exchange([(t(mine), nxt), (t(other), prv)], [(t(mine), prv), (t(other), nxt)],
                                         group)
    close(got_a, inp(f"p2p{tag}", prv, (3, 2)), "p2p both ways (forward ring)")
    close(got_b, inp(f"p2pb{tag}", nxt, (2, 5)), "p2p both ways (backward ring)")
    # group rank 0 sends two tensors to the last group rank; the others only take part
    a, b = inp(f"p2pa{tag}", rank, (2, 2)), inp(f"p2pc{tag}", rank, (4,))
    last = ranks[-1]
    sends = [(t(a), last), (t(b), last)] if me == 0 else []
    recvs = [(t(a), ranks[0]), (t(b), ranks[0])] if rank == last else []
    got = call(platform.p2p_exchange, sends, recvs, group, async_op=async_op)
    assert len(got) == len(recvs)
    if recvs:
        close(got[0], inp(f"p2pa{tag}", ranks[0], (2, 2)), "p2p first of two")
        close(got[1], inp(f"p2pc{tag}", ranks[0], (4,)), "p2p second of two")


def _overlapped(platform, ranks, group, rank):
    """Several async collectives in flight, waited out of order (and twice)."""
    n, me = len(ranks), ranks.index(rank)
    a, b, c = ([inp(f"ov{x}{ranks}", r, s) for r in ranks] for x, s in (("a", (4, 3)), ("b", (3 * n, 2)),
                                                                         ("c", (2, 5))))
    h1 = platform.all_gather(t(a[me]), group, dim=1, async_op=True)
    h2 = platform.reduce_scatter(t(b[me]), group, dim=0, op="sum", async_op=True)
    h3 = platform.all_reduce(t(c[me]), group, op="max", async_op=True)
    close(h3.wait(), np.stack(c).max(0), "overlapped all_reduce")
    close(h1.wait(), np.concatenate(a, 1), "overlapped all_gather")
    close(h2.wait(), np.split(np.stack(b).sum(0), n, 0)[me], "overlapped reduce_scatter")
    close(h1.wait(), np.concatenate(a, 1), "second wait()")


def _errors(platform, ranks, group):
    """Bad arguments raise ValueError before any communication."""
    n = len(ranks)
    if n > 1:
        expect_error(ValueError, lambda: platform.all_to_all_single(t(np.ones((3 * n + 1, 2), np.float32)),
                                                                    group, 0, 1), "divisible")
        expect_error(ValueError, lambda: platform.reduce_scatter(t(np.ones(3 * n + 1, np.float32)), group, 0),
                     "divisible")
    expect_error(ValueError, lambda: platform.reduce_scatter(t(np.ones(3 * n, np.float32)), group, 0, op="prod"),
                 "prod")
    expect_error(ValueError, lambda: platform.all_reduce(t(np.ones(3, np.float32)), group, op="prod"), "prod")


def raw_collectives(rank, world_size):
    """Returns the groups this rank checked (each sync and async)."""
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    checked = []
    for ranks, group in my_groups(platform, rank, world_size):
        me = ranks.index(rank)
        assert platform.group_ranks(group) == ranks
        assert platform.get_rank(group) == me and platform.get_world_size(group) == len(ranks)
        for async_op in (False, True):
            for check in (_all_gather, _all_reduce, _broadcast, _all_to_all, _reduce_scatter, _p2p):
                check(platform, ranks, group, rank, async_op)
        _overlapped(platform, ranks, group, rank)
        _errors(platform, ranks, group)
        checked.append(list(ranks))
    out = platform.all_gather(t(np.full((1, 2), rank, np.float32)), None, dim=0)
    close(out, np.repeat(np.arange(world_size, dtype=np.float32)[:, None], 2, 1), "all_gather with group=None")
    return checked


# =============================================================================== differentiable
def differentiable_collectives(rank, world_size):
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    checked = []
    for ranks, group in my_groups(platform, rank, world_size):
        n, me, tag = len(ranks), ranks.index(rank), f"{ranks}"

        def weights(name, shape):
            return [inp(f"w{name}{tag}", r, shape) for r in ranks]

        def grad(collective, x, w):
            """d/dx of sum(collective(x) * w) (the sum over ranks of these losses)."""
            return grad_of(lambda a: (collective(a) * t(w)).sum(), t(x))[0]

        # all_gather(dim=1): out = cat_j x_j; dL/dx_me = sum_j w_j[block me]
        xs, ws = [inp(f"dag{tag}", r, (2, 3)) for r in ranks], weights("ag", (2, 3 * n))
        close(platform.differentiable_all_gather(t(xs[me]), group, 1), np.concatenate(xs, 1),
              "differentiable all_gather forward")
        g = grad(lambda a: platform.differentiable_all_gather(a, group, 1), xs[me], ws[me])
        close(g, sum(np.split(w, n, 1)[me] for w in ws), f"all_gather backward {ranks}")
        # reduce_scatter(dim=0): out_me = sum_j x_j[block me]; dL/dx[block b] = w_b
        xs, ws = [inp(f"drs{tag}", r, (2 * n, 3)) for r in ranks], weights("rs", (2, 3))
        close(platform.differentiable_reduce_scatter(t(xs[me]), group, 0), np.split(sum(xs), n, 0)[me],
              "differentiable reduce_scatter forward")
        g = grad(lambda a: platform.differentiable_reduce_scatter(a, group, 0), xs[me], ws[me])
        close(g, np.concatenate(ws, 0), f"reduce_scatter backward {ranks}")
        # all_to_all(split 1, concat 0): the gradient is the inverse all-to-all of the weights
        xs, ws = [inp(f"da2a{tag}", r, (2, 3 * n)) for r in ranks], weights("a2a", (2 * n, 3))
        close(platform.differentiable_all_to_all(t(xs[me]), group, 1, 0),
              np.concatenate([np.split(x, n, 1)[me] for x in xs], 0), "differentiable all_to_all forward")
        g = grad(lambda a: platform.differentiable_all_to_all(a, group, 1, 0), xs[me], ws[me])
        close(g, np.concatenate([np.split(w, n, 0)[me] for w in ws], 1), f"all_to_all backward {ranks}")
        # all_reduce: sum (backward sum / identity), avg, max (the gradient goes to the winner)
        xs, ws = [inp(f"dar{tag}", r, (3,)) for r in ranks], weights("ar", (3,))
        g = grad(lambda a: platform.differentiable_all_reduce(a, group, "sum"), xs[me], ws[me])
        close(g, sum(ws), "all_reduce(sum) backward")
        g = grad(lambda a: platform.differentiable_all_reduce(a, group, "sum", backward="identity"),
                 xs[me], ws[me])
        close(g, ws[me], "all_reduce(sum, identity) backward")
        g = grad(lambda a: platform.differentiable_all_reduce(a, group, "avg"), xs[me], ws[me])
        close(g, sum(ws) / n, "all_reduce(avg) backward")
        winner = np.stack(xs).argmax(0)
        g = grad(lambda a: platform.differentiable_all_reduce(a, group, "max"), xs[me], ws[me])
        close(g, np.where(winner == me, sum(ws), 0.0), "all_reduce(max) backward")
        # p2p ring shift: out_me = x_prev; dL/dx_me = w_next
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        xs, ws = [inp(f"dp2p{tag}", r, (2, 2)) for r in ranks], weights("p2p", (2, 2))
        close(platform.differentiable_p2p_exchange(t(xs[me]), nxt, prv, group), xs[(me - 1) % n],
              "differentiable p2p forward")
        g = grad(lambda a: platform.differentiable_p2p_exchange(a, nxt, prv, group), xs[me], ws[me])
        close(g, ws[(me + 1) % n], f"p2p backward {ranks}")
        checked.append(list(ranks))
    return checked
