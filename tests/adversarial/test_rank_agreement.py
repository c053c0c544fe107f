"""Ranks that disagree (SPEC §19, issue 36 item 1): the agreement check and every feature that
uses it. Every case must raise the same ValueError on every rank naming the setting, and leave the
ranks in step; meshes carry a short timeout so a regression fails instead of hanging the suite."""
import pytest

from tests.cases import agreement as neutral
from tests.harness.frameworks import framework_worlds, run_on


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4, mindspore=(2,)))
def test_agreement_table(framework, world_size):
    assert run_on(framework, world_size, neutral.table, timeout=120) == [True] * world_size


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, mindspore=(2,)))
def test_agreement_schedule(framework, world_size):
    assert run_on(framework, world_size, neutral.schedule, timeout=120) == [True] * world_size


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, mindspore=(2,)) + [
    pytest.param("torch", 4, id="torch-4", marks=pytest.mark.agreement_full)])
def test_linear_attention_disagreements(framework, world_size):
    assert run_on(framework, world_size, neutral.linear_attention, timeout=120) == [True] * world_size


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, mindspore=(2,)))
def test_chunked_loss_disagreements(framework, world_size):
    assert run_on(framework, world_size, neutral.chunked_loss, timeout=120) == [True] * world_size


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, mindspore=(2,)))
def test_tp_input_differing_per_rank_under_check_every(framework, world_size):
    assert run_on(framework, world_size, neutral.tp_input_every, timeout=120) == [True] * world_size
