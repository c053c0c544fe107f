"""Per-object cache keys survive address reuse: a style created where a dead one lived must not
inherit its cached decisions (the first call's cross-rank check above all: skipped on one rank and
run on another, it leaves a rank alone in a collective)."""
from tests.harness import run_dist


def test_a_new_object_at_a_dead_ones_address_gets_a_new_key():
    from hyper_parallel.core.bounded_cache import lifetime_key

    class Thing:
        pass
    first = Thing()
    address, key = id(first), lifetime_key(first)
    assert lifetime_key(first) == key   # stable while it lives
    del first
    others = [Thing() for _ in range(64)]   # CPython hands the freed address out again
    assert any(id(t) == address for t in others), "the freed address never came back: not exercised"
    assert all(lifetime_key(t) != key for t in others)



def test_identity_table_entries_leave_with_their_object():
    """IdentityTable: by identity, not equality; an entry dies with its object; a new object at the
    dead one's address finds nothing; an object without weak references is refused."""
    from hyper_parallel.core.bounded_cache import IdentityTable

    class Thing:
        def __eq__(self, other):
            return True   # equal to everything: the table must not care

        __hash__ = object.__hash__
    table = IdentityTable()
    first, second = Thing(), Thing()
    table[first] = "first"
    assert table.get(first) == "first" and first in table
    assert table.get(second) is None and second not in table
    address = id(first)
    del first
    assert len(table) == 0
    others = [Thing() for _ in range(64)]
    assert any(id(t) == address for t in others), "the freed address never came back: not exercised"
    assert all(t not in table for t in others)
    try:
        table[(1, 2)] = "tuple"
    except TypeError:
        pass
    else:
        raise AssertionError("a tuple (no weak references) was accepted")

def _reused_address(rank, world_size):
    """A style at a verified style's freed address still runs the first call's check; a style and
    its module are freed with the model (nothing global keeps them)."""
    import os
    from unittest import mock
    with mock.patch.dict(os.environ, {"HP_CP_DEBUG": "0"}):   # the suite checks every call: not here
        return _reused_address_checked(world_size)


def _reused_address_checked(world_size):
    import gc
    import weakref
    import torch
    from hyper_parallel import ContextParallel, init_device_mesh, parallelize_module
    from hyper_parallel.core.context_parallel.checks import first_call_of_signature
    from tests.test_cp_auto import _core

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    q = torch.randn(1, 8, 2, 4)
    style = ContextParallel(ulysses_degree=1)
    module = parallelize_module(_core(), mesh, style)
    module(q, q, q)
    alive = (weakref.ref(style), weakref.ref(module))
    del style, module
    gc.collect()
    assert all(r() is None for r in alive)   # nothing global keeps a style or its module

    first = ContextParallel(ulysses_degree=1)
    assert first_call_of_signature(first, mesh, [q, q, q])
    assert not first_call_of_signature(first, mesh, [q, q, q])   # verified once
    address = id(first)
    del first   # freed at once: the next style of its size likely takes its address
    others = [ContextParallel(ulysses_degree=1) for _ in range(64)]
    reused = [s for s in others if id(s) == address]
    assert reused, "no style took the freed address: the case is not exercised"
    assert first_call_of_signature(reused[0], mesh, [q, q, q])
    return True


def test_a_style_at_a_freed_address_is_not_taken_for_the_dead_one():
    assert run_dist(2, _reused_address, timeout=60) == [True, True]
