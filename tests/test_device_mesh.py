"""DeviceMesh (SPEC §2) on world 4 (2x2, torch and MindSpore) and 8 (2x2x2, torch), and the
placements' value semantics.

The mesh cases (tests/cases/device_mesh.py) check every (sub-)mesh against a rank grid computed
independently with numpy and make every one of its groups communicate.
"""
import pytest

from tests.cases import device_mesh as cases
from tests.harness.frameworks import framework_worlds, run_on


@pytest.mark.parametrize("framework,world_size", framework_worlds(4))
def test_device_mesh_world4(framework, world_size):
    assert run_on(framework, 4, cases.world4) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("framework,world_size", framework_worlds(8))
def test_device_mesh_world8(framework, world_size):
    assert run_on(framework, 8, cases.world8) == [(r // 4, r // 2 % 2, r % 2) for r in range(8)]


# ============================================================================ placements (no ranks)
def test_placements_value_semantics():
    from hyper_parallel.core.dtensor import Partial, Replicate, Shard, StridedShard

    assert Shard(1) == Shard(1) and Shard(1) != Shard(0) and hash(Shard(1)) == hash(Shard(1))
    assert Replicate() == Replicate() and hash(Replicate()) == hash(Replicate())
    assert Partial() == Partial("sum") and Partial("sum") != Partial("avg")
    assert StridedShard(0, 2) == StridedShard(0, 2) and StridedShard(0, 2) != Shard(0)
    assert Shard(0) != StridedShard(0, 2) and StridedShard(0, 2) != StridedShard(0, 4)
    assert len({Shard(0), Shard(0), Replicate(), Partial(), Partial("sum"), Partial("max")}) == 4
    assert repr(Shard(1)) == "S(1)" and repr(Replicate()) == "R" and repr(Partial()) == "P(sum)"
    assert repr(Partial("max")) == "P(max)"
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert not Shard(1).is_replicate() and not Shard(1).is_partial()
    assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
    assert Partial("avg").is_partial() and not Partial().is_shard() and not Partial().is_replicate()
    assert StridedShard(0, 2).is_shard(0)
    assert Shard(-1).normalized(3) == Shard(2) and Shard(-3).normalized(3) == Shard(0)
    assert Shard(1).normalized(3) == Shard(1)
    assert StridedShard(-1, 2).normalized(2) == StridedShard(1, 2)
    assert Replicate().normalized(2) == Replicate() and Partial().normalized(2) == Partial()
    for bad in (Shard(3), Shard(-4)):
        with pytest.raises(ValueError):
            bad.normalized(3)
    with pytest.raises(ValueError):
        Partial("prod")
    with pytest.raises(ValueError):
        StridedShard(0, 0)
    for op in ("sum", "avg", "max", "min"):
        assert Partial(op).reduce_op == op
