"""Run a platform-neutral case (``tests/cases/``) on a framework's worker pool.

    @pytest.mark.parametrize("framework", FRAMEWORKS)
    def test_something(framework):
        results = run_on(framework, 2, cases.something, timeout=300)

``torch`` runs on the gloo pools of ``tests.harness.pool``; ``mindspore`` on the MindSpore pools of
``tests.mindspore.harness`` (workers under the MindSpore interpreter; the test is skipped without
one, or fails under ``HP_REQUIRE_MINDSPORE=1``). Results are per rank (index = rank) and should be
plain Python values, which cross both harnesses unchanged.
"""
import pytest

from tests.harness.pool import run_dist
from tests.mindspore.harness import require_mindspore, run_ms

FRAMEWORKS = ["torch", pytest.param("mindspore", marks=pytest.mark.mindspore)]


def run_on(framework, world_size, fn, *args, timeout=300, **kwargs):
    if framework == "torch":
        return run_dist(world_size, fn, *args, timeout=timeout, **kwargs)
    if framework == "mindspore":
        require_mindspore()
        return run_ms(world_size, fn, *args, timeout=timeout, **kwargs)
    raise ValueError(f"unknown framework {framework!r}; expected 'torch' or 'mindspore'")


def framework_worlds(*world_sizes, mindspore=(2, 4)):
    """``(framework, world_size)`` parameters: every size on torch, the ``mindspore`` ones on
    MindSpore (its ranks take ~10 s each to start on a small machine, so 8 is left to torch)."""
    params = [pytest.param("torch", w, id=f"torch-{w}") for w in world_sizes]
    params += [pytest.param("mindspore", w, id=f"mindspore-{w}", marks=pytest.mark.mindspore)
               for w in world_sizes if w in mindspore]
    return params
