"""DTensor op dispatch on every framework: the operator surface torch and MindSpore share, spelled
with each framework's own ops (tests/cases/dtensor.py), embedding lookups on every table layout, and
the replicated fallback / strict mode. The torch-only aten-level checks are in test_dtensor_ops.py.
"""
import pytest

from tests.cases import dtensor as neutral
from tests.harness.frameworks import FRAMEWORKS, framework_worlds, run_on


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4, mindspore=(2,)))
def test_common_ops_on_every_framework(framework, world_size):
    """The operator surface both frameworks share (elementwise, matmul / bmm / linear, views,
    softmax, reductions, cat / split / indexing, dropout, casts, SDPA, cumsum), spelled with each
    framework's own ops, every placement combination, forward and gradients (tests/cases/dtensor.py).
    MindSpore runs it on 2 ranks (its op table does not depend on the world; uneven shards on 4
    ranks are covered by the conversions test)."""
    counts = run_on(framework, world_size, neutral.ops_dispatch, timeout=280)
    assert counts[0] == counts[-1] and counts[0] >= 80


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4))
def test_embedding_lookup_every_table_layout(framework, world_size):
    """Vocab-parallel, column-parallel and replicated tables (torch F.embedding, MindSpore
    ops.gather(table, ids, 0) as nn.Embedding runs it), forward and the table's gradient."""
    assert run_on(framework, world_size, neutral.embedding_lookup) == [9] * world_size


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_fallback_warns_once_and_strict_mode_raises(framework):
    assert run_on(framework, 2, neutral.fallback_and_strict) == [True, True]
