"""Every raw and every differentiable collective of the platform against a numeric reference.

``test_raw_collectives`` and ``test_differentiable_collectives`` are platform-neutral
(tests/cases/collectives.py) and run on torch and on MindSpore. The rest is torch only: the layouts
of the gradients that reach gloo (transposed inputs, non-contiguous incoming gradients, tied
max/min winners, a replicated loss) and the bytes the comm observers see. Each rank builds every
rank's input deterministically, so it computes the expected result -- and the gradient of the SUM
of all ranks' losses -- locally. Many checks share one case to keep the round trips cheap.
"""
import zlib

import pytest

from tests.cases import collectives as neutral
from tests.harness import run_dist
from tests.harness.frameworks import framework_worlds, run_on

WORLD_SIZES = [2, 4, 8]
REDUCE_OPS = ("sum", "avg", "max", "min")
TOL = {"atol": 1e-5, "rtol": 1e-5}


# ============================================================================ helpers (run on ranks)
def _inp(tag, global_rank, shape):
    """The deterministic input of ``global_rank`` for check ``tag``."""
    import torch
    gen = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{global_rank}".encode()))
    return torch.randn(tuple(shape), generator=gen)


def _noncontig(t):
    """A non-contiguous view with the values of ``t`` (a transposed view where possible)."""
    import torch
    if t.dim() >= 2 and t.shape[0] > 1 and t.shape[1] > 1:
        view = t.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        buf = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
        buf[..., ::2] = t
        view = buf[..., ::2]
    assert torch.equal(view, t)
    assert not view.is_contiguous() or t.shape[-1] == 1
    return view


def _close(actual, expected, what):
    import torch
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _reduce(stacked, op):
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.mean(0)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _split(t, dim, n, k):
    """Block ``k`` of ``n`` equal blocks of ``t`` along ``dim``."""
    size = t.shape[dim] // n
    return t.narrow(dim, k * size, size)


# ============================================================================ on every framework
@pytest.mark.parametrize("framework,world_size", framework_worlds(*WORLD_SIZES))
def test_raw_collectives(framework, world_size):
    """all_gather, all_reduce, broadcast, all_to_all(_single), reduce_scatter and p2p_exchange on
    the world, the reversed world and sub-groups, every dtype/dim/op, sync and async, errors
    (tests/cases/collectives.py)."""
    checked = run_on(framework, world_size, neutral.raw_collectives, timeout=280)
    for rank, groups in enumerate(checked):
        assert groups == [list(g) for g in neutral.groups_for(world_size) if rank in g]


@pytest.mark.parametrize("framework,world_size", framework_worlds(*WORLD_SIZES))
def test_differentiable_collectives(framework, world_size):
    """Forward and gradient of every differentiable collective on every group, from numpy."""
    checked = run_on(framework, world_size, neutral.differentiable_collectives, timeout=280)
    for rank, groups in enumerate(checked):
        assert groups == [list(g) for g in neutral.groups_for(world_size) if rank in g]


# ============================================================================ differentiable collectives
def _loss(out, weight, transposed):
    """``(out * weight).sum()``; with ``transposed`` built from transposed views, so the gradient
    arriving at ``out`` is non-contiguous."""
    if transposed:
        return (out.transpose(0, -1) * weight.transpose(0, -1).contiguous()).sum()
    return (out * weight).sum()


def _grad_check(what, ranks, i, in_shape, dist_fn, sim_fn, *, transposed_input=False,
                transposed_grad=False, shared_loss=False, ties=False):
    """Run ``dist_fn`` on this rank's input with loss ``<out, w_rank>``, and compare the output
    and the input gradient with a local simulation of every rank: ``sim_fn(inputs) -> outputs``
    and the gradient of the SUM of all ranks' losses (or, with ``shared_loss``, of the one loss
    every rank holds a replica of: the same weight everywhere, counted once)."""
    n = len(ranks)
    xs = [_inp(f"{what}/x", r, in_shape) for r in ranks]
    if ties:  # equal values across ranks in one slice (max/min must split the gradient)
        common = _inp(f"{what}/tie", -1, xs[0][0].shape)
        for x in xs:
            x[0] = common

    def prep(x):
        return x.transpose(0, 1) if transposed_input else x

    mine = xs[i].clone().requires_grad_()
    inp = prep(mine)
    assert inp.is_contiguous() != transposed_input
    out = dist_fn(inp)
    assert out.is_contiguous()
    weights = [_inp(f"{what}/w", -1 if shared_loss else r, out.shape) for r in ranks]
    seen = []
    out.register_hook(lambda g: seen.append(g.is_contiguous()))
    _loss(out, weights[i], transposed_grad).backward()
    assert seen == [not transposed_grad], f"{what}: incoming grad contiguity {seen}"

    leaves = [x.clone().requires_grad_() for x in xs]
    outs = sim_fn([prep(x) for x in leaves])
    assert len(outs) == n
    if shared_loss:
        total = _loss(outs[i], weights[i], transposed_grad)
    else:
        total = sum(_loss(o, w, transposed_grad) for o, w in zip(outs, weights))
    total.backward()
    where = f"{what} on group {ranks}, rank {ranks[i]}"
    _close(out.detach(), outs[i].detach(), f"{where}: forward")
    _close(mine.grad, leaves[i].grad, f"{where}: gradient")


def _check_differentiable(platform, ranks, group, rank):
    import torch
    n, i = len(ranks), ranks.index(rank)

    # all-gather; backward = reduce-scatter of the gradients
    for dim, t_in, t_grad in ((0, False, False), (1, True, False), (2, False, True), (1, True, True)):
        _grad_check(f"d_all_gather dim={dim} ti={t_in} tg={t_grad}", ranks, i, (3, 5, 7),
                    lambda x, d=dim: platform.differentiable_all_gather(x, group, dim=d),
                    lambda xs, d=dim: [torch.cat(xs, d)] * n,
                    transposed_input=t_in, transposed_grad=t_grad)

    # reduce-scatter; backward = all-gather
    for dim, t_in, t_grad in ((0, False, False), (1, True, True)):
        shape = [5, 7]
        shape[1 - dim if t_in else dim] = 3 * n  # the leaf is transposed when t_in
        _grad_check(f"d_reduce_scatter dim={dim} ti={t_in} tg={t_grad}", ranks, i, shape,
                    lambda x, d=dim: platform.differentiable_reduce_scatter(x, group, dim=d),
                    lambda xs, d=dim: [_split(torch.stack(xs).sum(0), d, n, k) for k in range(n)],
                    transposed_input=t_in, transposed_grad=t_grad)

    # all-to-all; backward = the inverse all-to-all
    for (split_dim, concat_dim), t_in, t_grad in (((0, 0), False, False), ((0, 2), True, False),
                                                  ((2, 1), False, True), ((1, 0), True, True)):
        shape = [3, 5, 7]
        leaf_dim = {0: 1, 1: 0}.get(split_dim, split_dim) if t_in else split_dim
        shape[leaf_dim] = 3 * n

        def sim(xs, s=split_dim, c=concat_dim):
            return [torch.cat([_split(x, s, n, k) for x in xs], c) for k in range(n)]
        _grad_check(f"d_all_to_all {split_dim}->{concat_dim} ti={t_in} tg={t_grad}", ranks, i, shape,
                    lambda x, s=split_dim, c=concat_dim: platform.differentiable_all_to_all(x, group, s, c),
                    sim, transposed_input=t_in, transposed_grad=t_grad)

    # all-reduce: "sum" backward (each rank's loss differs) and "identity" (replicated loss);
    # max/min send the gradient to the winners, split evenly over ties
    for op in REDUCE_OPS:
        for mode in ("sum", "identity"):
            _grad_check(f"d_all_reduce op={op} backward={mode}", ranks, i, (4, 3, 5),
                        lambda x, o=op, m=mode: platform.differentiable_all_reduce(x, group, o, m),
                        lambda xs, o=op: [_reduce(torch.stack(xs), o)] * n,
                        transposed_input=op == "max", transposed_grad=mode == "identity",
                        shared_loss=mode == "identity", ties=op in ("max", "min"))

    # p2p exchange: the gradient goes back to the source, in both ring directions
    if n > 1:
        for step, t_grad in ((1, False), (-1, True)):
            send_to, recv_from = ranks[(i + step) % n], ranks[(i - step) % n]
            _grad_check(f"d_p2p step={step}", ranks, i, (3, 5),
                        lambda x, s=send_to, r=recv_from: platform.differentiable_p2p_exchange(
                            x, s, r, group),
                        lambda xs, st=step: [xs[(k - st) % n] for k in range(n)],
                        transposed_input=step == 1, transposed_grad=t_grad)
    return True


def _differentiable_case(rank, world_size):
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    return [ranks for ranks, group in neutral.my_groups(platform, rank, world_size)
            if _check_differentiable(platform, ranks, group, rank)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_torch_gradient_layouts(world_size):
    """torch only: transposed inputs, non-contiguous incoming gradients (gloo mishandles them if
    they reach it), tied max/min winners, a replicated loss (backward="identity")."""
    checked = run_dist(world_size, _differentiable_case)
    for rank, groups in enumerate(checked):
        assert groups == [g for g in neutral.groups_for(world_size) if rank in g]


# ============================================================================ communication accounting
def _observer_case(rank, world_size):
    import torch
    from hyper_parallel.platform import get_platform
    platform = get_platform()
    log = []

    def observer(op, nbytes, group_ranks):
        log.append((op, nbytes, tuple(group_ranks)))

    def recorded(fn):
        log.clear()
        fn()
        return list(log)

    platform.add_comm_observer(observer)
    try:
        for ranks, group in neutral.my_groups(platform, rank, world_size):
            n, i = len(ranks), ranks.index(rank)
            if n == 1:
                assert recorded(lambda: platform.all_gather(torch.ones(3), group)) == []
                continue
            x = torch.randn(6 * n, 5)
            nbytes = x.numel() * x.element_size()
            assert recorded(lambda: platform.all_gather(x, group, dim=1)) == \
                [("all_gather", (n - 1) * nbytes, ranks)]
            assert recorded(lambda: platform.all_to_all_single(x, group, 0, 1)) == \
                [("all_to_all", (n - 1) * nbytes // n, ranks)]
            assert recorded(lambda: platform.reduce_scatter(x, group, 0)) == \
                [("reduce_scatter", (n - 1) * nbytes // n, ranks)]
            assert recorded(lambda: platform.all_reduce(x, group)) == \
                [("all_reduce", 2 * (n - 1) * nbytes // n, ranks)]
            assert recorded(lambda: platform.broadcast(x, ranks[-1], group)) == \
                ([("broadcast", nbytes, ranks)] if rank == ranks[-1] else [])
            nxt, prv = ranks[(i + 1) % n], ranks[(i - 1) % n]
            assert recorded(lambda: platform.p2p_exchange([(x, nxt)], [(x, prv)], group)) == \
                [("send_recv", nbytes, ranks)]
            pieces = [torch.ones(k + 1, 2) for k in range(n)]
            sent = sum(p.numel() * 4 for k, p in enumerate(pieces) if k != i)
            shapes = [(i + 1, 2)] * n
            assert recorded(lambda: platform.all_to_all(pieces, group, out_shapes=shapes)) == \
                [("all_to_all", sent, ranks)]
            # differentiable: forward all-gather, backward reduce-scatter of an n-times larger grad
            leaf = x.clone().requires_grad_()
            assert recorded(lambda: platform.differentiable_all_gather(leaf, group, 0).sum().backward()) \
                == [("all_gather", (n - 1) * nbytes, ranks), ("reduce_scatter", (n - 1) * nbytes, ranks)]
            assert recorded(lambda: platform.differentiable_all_to_all(leaf, group, 0, 1).sum().backward()) \
                == [("all_to_all", (n - 1) * nbytes // n, ranks)] * 2
    finally:
        platform.remove_comm_observer(observer)
    log.clear()
    platform.all_reduce(torch.ones(2), None)
    assert log == [], "a removed observer was still called"
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_comm_observer_bytes(world_size):
    assert run_dist(world_size, _observer_case) == [True] * world_size
