"""MLA's attend path when the CP ranks disagree (SPEC §19): a ValueError naming the setting on every
rank (was a silently different attention, or a hang for load_balance); and after steady state one rank
changing the scale alone raises on that rank and times out (bounded) on its peers."""
from tests.cases import agreement_mla as cases
from tests.harness import kill_pool, run_dist


def test_mla_attend_disagreements():
    assert run_dist(2, cases.disagreements, timeout=120) == [True, True]


def test_mla_attend_gap():
    try:
        assert run_dist(2, cases.gap, timeout=60) == [True, True]
    finally:
        kill_pool(2)
