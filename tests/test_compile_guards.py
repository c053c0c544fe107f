"""Settings that change after compile (SPEC §18 with §19, docs/compile.md "Guards").

A compiled block keeps what its forward read while it was traced. compile_module's key includes
the public plain-valued attributes of the block's modules, so changing one (an attention's window
or causality) makes a new signature: the result is that of eager mode with the new setting, never
the stale graph's. The first call of every signature runs eagerly, so SPEC §19's first-call checks
exchange real values again (a trace only sees fake ones): ranks that change a setting differently
get the ValueError naming it; the graph is made at the next call.
"""
import pytest

from tests.harness import run_dist
from tests.test_compile import _attention_block, _compare_steps, _inputs

# (is_causal, window) per step: plain causal, a sliding window, bidirectional, back to the first
SETTINGS = [(True, None), (True, 3), (False, None), (True, None)]


def _attention():
    """BSHD core attention whose causality and window are module attributes (read by forward)."""
    import torch.nn as nn
    from hyper_parallel import attention

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.causal, self.window = True, None

        def forward(self, q, k, v):
            out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal,
                            window=self.window)
            return out.transpose(1, 2)
    return Attention()


def _set(block, causal, window):
    block.attention.causal, block.attention.window = causal, window


def _settings_case(rank, world):
    import copy

    from hyper_parallel import ContextParallel, init_device_mesh
    from hyper_parallel.platform.torch.compile_support import compile_module, compiled_of

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ref = _attention_block(_attention())
    eager, compiled = copy.deepcopy(ref), copy.deepcopy(ref)
    for module in (eager, compiled):
        ContextParallel(ulysses_degree=1).apply(module.attention, mesh)
    compile_module(compiled, backend="aot_eager")

    def make_inputs(step):
        return _inputs(step, world, rank)
    for causal, window in SETTINGS:   # two steps each: the first runs eagerly, the second compiled
        for module in (eager, compiled):
            _set(module, causal, window)
        _compare_steps(compiled, eager, make_inputs, 2, f"causal={causal}, window={window}")
    entries = compiled_of(compiled).compiled.values()
    signatures = sorted((state["calls"], state["traced"]) for _, _, _, state in entries)
    # the ranks change the window differently: the new graph's trace compares it (for real)
    _set(compiled, True, 4 + rank)   # new to both ranks: both trace, both check
    with pytest.raises(ValueError) as error:
        compiled(make_inputs(0)[0][0])
    return signatures, str(error.value)


def test_changed_setting_recompiles_and_is_checked_again():
    """Window / causal changed between calls of a compiled all-gather CP block: every step equals
    eager with the new setting; three settings, three graphs, each traced (the last setting is the
    first one again: its graph is reused); then ranks that set different windows get a ValueError
    naming 'window' on every rank."""
    results = run_dist(2, _settings_case, timeout=600)
    for rank, (signatures, message) in enumerate(results):
        assert signatures == [(2, True), (2, True), (4, True)], results
        assert "disagree on window" in message and f"rank {rank} has {4 + rank}" in message, message
