"""ContextParallel's grouped config: the flat keywords land in their groups, the flat attribute
names still read them, and the checks raise the same errors whichever way the config is built."""
import dataclasses

import pytest

from hyper_parallel import AsyncContextParallel, ContextParallel
from hyper_parallel.core.context_parallel.auto.cost_model import Candidate, Family, family
from hyper_parallel.core.context_parallel.config import (CPAuto, CPExchange, CPLayout, CPOverlap,
                                                         ContextParallelConfig)


def test_flat_keywords_fill_the_groups_and_read_back():
    style = ContextParallel(seq_dim=2, head_dim=1, ulysses_degree=1, qkv_indices=[0, 1, 2],
                            load_balance=True, chunks=3)
    cfg = style.config
    assert cfg.layout == CPLayout(2, 1, (0, 1, 2), (), False)
    assert cfg.exchange == CPExchange(1, True, "allgather")
    assert cfg.overlap == CPOverlap(False, 3)
    assert cfg.auto == CPAuto()
    assert (style.seq_dim, style.head_dim, style.qkv_indices, style.ulysses_degree, style.load_balance,
            style.chunks, style.mode, style.causal, style.tune) == \
        (2, 1, (0, 1, 2), 1, True, 3, None, True, True)
    with pytest.raises(AttributeError):
        style.seq_dim = 3


def test_auto_hints_and_fixed_substyle():
    style = ContextParallel(mode="auto", causal=False, tune=False, memory_budget=1e9)
    assert (style.causal, style.tune, style.memory_budget) == (False, False, 1e9)
    assert style.config.auto.causal is False and style.last_choice is None
    sub = AsyncContextParallel(chunks=4).fixed(ulysses_degree=1, kv_exchange="ring")
    assert type(sub) is ContextParallel
    assert (sub.overlap, sub.chunks, sub.kv_exchange, sub.ulysses_degree, sub.mode) == \
        (True, 4, "ring", 1, None)


def test_groups_check_on_build():
    with pytest.raises(ValueError, match="seq_dim and head_dim must differ"):
        CPLayout(seq_dim=1, head_dim=1)
    with pytest.raises(ValueError, match="load_balance=True needs ulysses_degree=1"):
        CPExchange(ulysses_degree=2, load_balance=True)
    with pytest.raises(ValueError, match="chunks"):
        CPOverlap(chunks=0)
    with pytest.raises(ValueError, match=r"\['tune'\] only apply to mode='auto'"):
        CPAuto(tune=True)
    with pytest.raises(ValueError, match=r"drop \['kv_exchange', 'ulysses_degree'\] or drop mode='auto'"):
        ContextParallelConfig(exchange=CPExchange(2, False, "ring"), auto=CPAuto(mode="auto"))
    cfg = ContextParallelConfig(auto=CPAuto(mode="auto"))
    with pytest.raises(ValueError, match=r"drop \['load_balance', 'ulysses_degree'\]"):
        dataclasses.replace(cfg, exchange=CPExchange(1, True))
    assert ContextParallel.from_config(cfg).mode == "auto"


def test_candidate_family_is_an_enum_with_the_printed_names():
    hybrid = Candidate(Family.HYBRID_RING, 2, "ring", False)
    assert (hybrid.name, family(hybrid)) == ("hybrid-ring(ds=2)", "hybrid-ring")
    plain = Candidate("allgather-lb", 1, "allgather", True)
    assert plain.family is Family.ALLGATHER_LB and plain.name == "allgather-lb"
    with pytest.raises(ValueError):
        Candidate("hybrid(ds=2)", 2, "allgather", False)
