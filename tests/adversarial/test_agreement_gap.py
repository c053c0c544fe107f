"""The agreement check's schedule gap (SPEC §19, issue 36): after steady state one rank alone changes a
setting to a key verified earlier. Each case must end in a ValueError naming the feature and the
setting on that rank and a bounded timeout on its peers, never a silent result or a gloo abort; the
steady state must stay free of collectives (CommDebugMode counts)."""
import pytest

from tests.cases import agreement_gap as cases
from tests.harness import kill_pool
from tests.harness.frameworks import framework_worlds, run_on


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, mindspore=(2,)))
def test_steady_state_exchanges_nothing(framework, world_size):
    assert run_on(framework, world_size, cases.steady_state_is_free, timeout=60) == [True] * world_size


@pytest.mark.parametrize("case", ["generic_gap", "chunked_loss_gap", "cp_window_gap", "linear_attention_gap",
                                  "fully_shard_extra_call"])
def test_one_rank_changing_alone_is_caught(case):
    from tests.harness import run_dist
    try:
        assert run_dist(2, getattr(cases, case), timeout=60) == [True, True]
    finally:
        kill_pool(2)   # the peers' collective timed out: their groups are spent
