"""The MindSpore platform's emulated collectives (real multi-process MindSpore on CPU): the bytes
they report and the capability table. Values and gradients of every collective are tested on
both platforms in tests/test_collectives.py."""
import pytest

from tests.mindspore import cases_collectives as cases
from tests.mindspore.harness import require_mindspore, run_ms


pytestmark = pytest.mark.mindspore


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


@pytest.mark.parametrize("world_size", [2, 4])
def test_emulated_bytes_and_capability_table(world_size):
    caps = run_ms(world_size, cases.bytes_and_capabilities)[0]
    assert caps["all_gather"].startswith("native") and caps["broadcast"] == "native"
    assert caps["all_to_all_single"].startswith("emulated")
