"""Every path by which a DTensor can reach a MindSpore compiled graph (cases in
tests/mindspore/cases_compiler_paths.py): arguments, default and keyword defaults, closures and
nonlocal helpers, module globals and helpers returning them, attributes of plain objects, dataclass
fields, functools.partial arguments, containers 4 deep, class attributes, a method of a plain class,
Cells reading a DTensor from a list / dict / class attribute / module global, in CellList,
SequentialCell or a plain dict of Cells, a TP Cell in a plain list attribute, ``from_local`` inside the
compiled function, ``ms.export`` of a Cell holding a DTensor -- x ms.jit ast / bytecode / trace and
GRAPH_MODE x a TP parameter's DTensor view and an activation. Each call, first and cached second,
equals numpy's value or raises the GRAPH_MODE error; the same graphs on a plain tensor of the full value
compute numpy's value."""
import pytest

from tests.mindspore import cases_compiler_paths as cases
from tests.mindspore.harness import require_mindspore, run_ms

pytestmark = pytest.mark.mindspore


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


# DTensor paths that compute the right value instead of refusing: ast runs the partial object's call in
# Python (MindSpore's JIT fallback), where the DTensor dispatch works; bytecode capture breaks the graph
# at a DTensor it reaches through an attribute, a helper or a Cell's container (its placeholder has an
# unknown rank, platform/mindspore/dtensor_base.py) and runs that part in Python
_BYTECODE_IN_PYTHON = ("global_helper", "attribute", "dataclass_field", "partial_argument",
                       "plain class method", "Cell list attribute", "Cell dict attribute",
                       "Cell class attribute")
COMPUTED = {"parameter | ast | partial_argument", "activation | ast | partial_argument"} | \
    {f"{kind} | bytecode | {path}" for kind in ("parameter", "activation") for path in _BYTECODE_IN_PYTHON}


def test_every_path_into_a_compiled_graph_computes_right_or_refuses():
    tables = run_ms(2, cases.paths_table, timeout=600)
    assert tables[0] == tables[1], "the ranks disagree"
    table = tables[0]
    assert table.pop("plain | ms.export | Cell list attribute") == ["exported", "exported"]
    bad = {case: outcome for case, outcome in table.items()
           if any(o not in ("right", "refused") for o in outcome)}
    assert not bad, "\n".join(f"{case}: {outcome}" for case, outcome in bad.items())
    plain = {case: outcome for case, outcome in table.items() if case.startswith("plain |")}
    assert plain and all(o == ["right", "right"] for o in plain.values()), plain
    # the generated table is the whole product (a path lost would go unnoticed)
    expected = set(cases.expected_cases()) - {"plain | ms.export | Cell list attribute"}
    assert set(table) == expected, set(table) ^ expected
    dtensor = {case: o for case, o in table.items() if not case.startswith("plain |")}
    computed = {case for case, o in dtensor.items() if o != ["refused", "refused"]}
    assert computed == COMPUTED, computed


def test_grad_and_fullgraph_compute_right_or_refuse():
    """ms.grad around and inside ms.jit, GRAPH_MODE grad / value_and_grad, bytecode fullgraph=True."""
    tables = run_ms(2, cases.grad_and_fullgraph, timeout=300)
    assert tables[0] == tables[1], "the ranks disagree"
    for case, outcome in tables[0].items():
        assert outcome == ["right", "right"] if case.startswith("plain |") else \
            all(o in ("right", "refused") for o in outcome), (case, outcome)
