"""MindSpore: paths that take a DTensor's own data (a placeholder without data) instead of its shard
(cases in tests/mindspore/cases_placeholder_reads.py; SPEC §19, issue 36 item 7). ``ms.Tensor(dt)``,
``param.set_data(dt)``, ``assign_value``, ``plain.copy_(dt)`` and ``ms.grad`` with respect to a DTensor
raise naming the fix; every op taking a list / tuple with DTensors among them (old-style ``ops.stack``,
``ops.addn``, ``ops.Stack(axis)``... which do not look inside the sequence, and the pyboost ones which
do) equals numpy's value on the full tensors, on a row-sharded and a replicated DTensor."""
import pytest

from tests.mindspore import cases_placeholder_reads as cases
from tests.mindspore.harness import require_mindspore, run_ms

pytestmark = pytest.mark.mindspore


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


def test_no_path_reads_the_placeholder():
    tables = run_ms(2, cases.placeholder_reads, timeout=180)
    assert tables[0].keys() == tables[1].keys(), "the ranks ran different paths"
    for rank, table in enumerate(tables):
        for path, outcome in table.items():
            fragment = cases.RAISES.get(path)
            if fragment is None:
                assert outcome == "right", (rank, path, outcome)
            else:
                assert outcome.startswith("raised:") and fragment in outcome, (rank, path, outcome)
    assert set(cases.RAISES) <= set(tables[0]), set(cases.RAISES) - set(tables[0])
    assert len(tables[0]) >= 40, len(tables[0])
