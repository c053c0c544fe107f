"""The MindSpore platform's collectives on real multi-process MindSpore (CPU, world 2 and 4).

Raw and differentiable collectives, native and emulated, on the world, the reversed world and
disjoint sub-groups, against numpy references computed on every rank (tests/mindspore/
cases_collectives.py); the bytes the emulations report; the capability table.
"""
import pytest

from tests.mindspore import cases_collectives as cases
from tests.mindspore.harness import require_mindspore, run_ms

WORLD_SIZES = [2, 4]


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_raw_collectives(world_size):
    per_rank = run_ms(world_size, cases.raw_collectives, timeout=400)
    # every rank checked every group it belongs to, sync and async
    assert per_rank == [2 * sum(r in g for g in cases.groups_for(world_size)) for r in range(world_size)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_differentiable_collectives(world_size):
    per_rank = run_ms(world_size, cases.differentiable_collectives, timeout=400)
    assert per_rank == [sum(r in g for g in cases.groups_for(world_size)) for r in range(world_size)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_emulated_bytes_and_capability_table(world_size):
    caps = run_ms(world_size, cases.bytes_and_capabilities)[0]
    assert caps["all_gather"].startswith("native") and caps["broadcast"] == "native"
    assert caps["all_to_all_single"].startswith("emulated")
