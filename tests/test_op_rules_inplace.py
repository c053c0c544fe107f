"""Rules at the aten level (hyper_parallel/core/dtensor/aten_rules.py): in-place forms of ops with a
rule (addmm_, scatter_, index_add_, cumsum_, masked_fill_...), ``copy_`` across layouts and
broadcasts, ``out=``, and advanced indexing (``x[idx]``, ``x[mask]``, ``x[idx] = v``). Each case on
DTensors in several layouts, uneven shards included, against torch on the full tensors, forward and
gradients, with no replicated fallback (the case machinery of tests/test_op_rules.py); then the
in-place effects themselves: the target keeps its placements and storage, views see the write, a
write through a view reaches the base."""
import pytest

from tests.harness import run_dist
from tests.test_op_rules import _check_case, _ids, _inputs


def _setitem(x, value, *index):
    y = x.clone()
    y[index if len(index) > 1 else index[0]] = value
    return y


def _inplace_cases():
    import torch
    distinct = torch.tensor([4, 0, 2])
    return {
        "addmm_": (lambda: _inputs((5, 7), (5, 6), (6, 7)),
                   lambda b, x, w: b.clone().addmm_(x, w, beta=0.5, alpha=2.0),
                   [["R", 0, "R"], ["R", 1, 0], [1, "R", 1], [0, 0, "R"], ["P", "P", "R"]]),
        "baddbmm_": (lambda: _inputs((3, 5, 7), (3, 5, 6), (3, 6, 7)),
                     lambda b, x, y: b.clone().baddbmm_(x, y), [[0, 0, 0], [2, "R", 2], ["R", 2, 1]]),
        "addmv_": (lambda: _inputs((5,), (5, 6), (6,)), lambda b, m, v: b.clone().addmv_(m, v),
                   [[0, 0, "R"], ["R", 1, 0]]),
        "scatter_": (lambda: _inputs((6, 5), (6, 2), ints=[_ids((6, 2), 5)]),
                     lambda x, s, i: x.clone().scatter_(1, i, s), [[0, 0, 0], [1, "R", "R"], ["R", "R", 0]]),
        "scatter_add_": (lambda: _inputs((6, 5), (6, 2), ints=[_ids((6, 2), 5)]),
                         lambda x, s, i: x.clone().scatter_add_(1, i, s), [[0, 0, "R"], ["R", 0, 0]]),
        "scatter_value_": (lambda: _inputs((6, 5), ints=[_ids((6, 2), 5)]),
                           lambda x, i: x.clone().scatter_(1, i, 2.5), [[0, 0], [1, "R"]]),
        "index_fill_": (lambda: _inputs((7, 5), ints=[_ids((3,), 7)]),
                        lambda x, i: x.clone().index_fill_(0, i, -2.0), [[1, "R"], [0, "R"], ["P", "R"]]),
        "index_copy_": (lambda: _inputs((7, 5), (3, 5), ints=[distinct]),
                        lambda x, s, i: x.clone().index_copy_(0, i, s),
                        [[1, 1, "R"], [1, "R", "R"], [0, 1, "R"]]),
        "index_add_": (lambda: _inputs((7, 5), (4, 5), ints=[_ids((4,), 7)]),
                       lambda x, s, i: x.clone().index_add_(0, i, s, alpha=3.0),
                       [[1, 1, "R"], [0, "R", "R"]]),
        "cumsum_": (lambda: _inputs((7, 5)), lambda x: x.clone().cumsum_(0), [[0], [1], ["P"]]),
        "masked_fill_": (lambda: _inputs((5, 7), ints=[_ids((7,), 2) == 1]),
                         lambda x, m: x.clone().masked_fill_(m, -1.5), [[0, "R"], [1, 0], ["P", "R"]]),
        "clamp_": (lambda: _inputs((5, 7)), lambda x: x.clone().clamp_(-0.5, 0.5), [[0], [1], ["P"]]),
        "copy_": (lambda: _inputs((5, 7), (5, 7)), lambda d, s: d.clone().copy_(s),
                  [[0, 1], ["P", 0], [1, "P"]]),
        "copy_broadcast": (lambda: _inputs((5, 7), (1, 7)), lambda d, s: d.clone().copy_(s),
                           [[0, 1], [1, "R"], ["P", "R"], [0, "P"]]),
    }


def _indexing_cases():
    import torch
    rows = _ids((4,), 7)
    return {
        "index_rows": (lambda: _inputs((7, 5), ints=[rows]), lambda x, i: x[i],
                       [[1, "R"], [0, "R"], ["P", "R"], ["R", 0]]),
        # an embedding table split over its columns (TP) looked up by a batch of token ids
        "index_embedding": (lambda: _inputs((7, 5), ints=[_ids((2, 3), 7)]), lambda w, i: w[i], [[1, "R"]]),
        "index_middle": (lambda: _inputs((3, 7, 5), ints=[rows]), lambda x, i: x[:, i],
                         [[0, "R"], [2, "R"], [1, 0]]),
        "index_apart": (lambda: _inputs((4, 6, 5), ints=[_ids((3,), 4), _ids((3,), 5, 2)]),
                        lambda x, i, j: x[i, :, j], [[1, "R", "R"], [0, "R", "R"], [2, "R", 0]]),
        "index_mask": (lambda: _inputs((5, 7), ints=[_ids((5, 7), 2) == 1]), lambda x, m: x[m],
                       [[0, "R"], [1, 1], ["P", "R"]]),
        "index_mask_rows": (lambda: _inputs((5, 7), ints=[_ids((5,), 2) == 1]), lambda x, m: x[m],
                            [[1, "R"], [0, 0]]),
        "index_put": (lambda: _inputs((7, 5), (4, 5), ints=[torch.tensor([6, 0, 3, 1])]), _setitem,
                      [[1, 1, "R"], [0, "R", "R"], ["R", 1, "R"], [1, "R", 0], ["P", "R", "R"]]),
        "index_put_broadcast": (lambda: _inputs((7, 5), (5,), ints=[torch.tensor([6, 0, 3])]), _setitem,
                                [[1, 0, "R"], [0, "R", "R"]]),
        "index_put_accumulate": (lambda: _inputs((7, 5), (4, 5), ints=[_ids((4,), 7)]),
                                 lambda x, v, i: x.clone().index_put_((i,), v, accumulate=True),
                                 [[1, 1, "R"], [0, 1, "R"]]),
        "index_put_mask": (lambda: _inputs((5, 7), ints=[_ids((5,), 2) == 1]),
                           lambda x, m: _setitem(x, 0.5, m), [[1, "R"], [0, 0]]),
    }


def _all_cases():
    return {**_inplace_cases(), **_indexing_cases()}


def _check_all(rank, world_size, mesh_shape):
    names = sorted(_all_cases())
    for name in names:
        _check_case(rank, world_size, mesh_shape, name, table=_all_cases)
    return names


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_aten_level_rules_match_one_device(mesh_shape):
    names = run_dist(4, _check_all, mesh_shape, timeout=900)
    assert len(names[0]) >= 20 and all(n == names[0] for n in names)


def _in_place_effects(rank, world_size):
    """An in-place op keeps the target's placements and (where the rule leaves it in place) its
    storage; a view of the target sees the write; a write into a view that had to gather reaches the
    base; out= writes into out in out's own layout; bad out= shapes raise before any collective."""
    import torch
    from hyper_parallel import Shard, distribute_tensor, init_device_mesh
    from hyper_parallel.core.dtensor.dispatch.fallback import recording_fallbacks
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(1)
    x, a, b = torch.randn(5, 7, generator=g), torch.randn(5, 6, generator=g), torch.randn(6, 7, generator=g)
    with recording_fallbacks() as fallbacks:
        d = distribute_tensor(x, mesh, [Shard(1)])
        ptr, view = d.to_local().data_ptr(), d[1:3]           # a slice of an unsplit dim: a true view
        d.addmm_(distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)]))
        want = x.addmm(a, b)
        assert d.placements == (Shard(1),) and d.to_local().data_ptr() == ptr
        torch.testing.assert_close(d.full_tensor(), want)
        torch.testing.assert_close(view.full_tensor(), want[1:3])
        part = d[:, 2:6]                                      # a slice of the split dim: gathered
        part.index_fill_(0, torch.tensor([0, 4]), 9.0)
        want[:, 2:6].index_fill_(0, torch.tensor([0, 4]), 9.0)
        torch.testing.assert_close(d.full_tensor(), want)
        out = distribute_tensor(torch.zeros(5, 7), mesh, [Shard(0)])
        mask = x > 0
        other = torch.arange(7.0)                             # a plain tensor, broadcast
        got = torch.where(distribute_tensor(mask, mesh, [Shard(1)]), d, other, out=out)
        assert got is out and out.placements == (Shard(0),)
        torch.testing.assert_close(out.full_tensor(), torch.where(mask, want, other))
        with pytest.raises(ValueError, match="does not resize"):
            torch.where(distribute_tensor(mask, mesh, [Shard(1)]), d, other,
                        out=distribute_tensor(torch.zeros(5, 8), mesh, [Shard(0)]))
        leaf = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        leaf[torch.tensor([0, 3, 3])].full_tensor().sum().backward()   # a leaf's gradient: its layout
        assert leaf.grad.placements == (Shard(1),), leaf.grad.placements
        torch.testing.assert_close(leaf.grad.full_tensor(), torch.zeros(5, 7).index_put_(
            (torch.tensor([0, 3, 3]),), torch.ones(3, 7), accumulate=True))
    assert not fallbacks, sorted(fallbacks)
    return True


def test_in_place_effects_on_target_views_and_out():
    assert run_dist(4, _in_place_effects) == [True] * 4
