"""``context_parallel_delta_rule``: the gated delta rule (GDN / KDA) on sequence blocks, exact.

Each CP rank holds a contiguous block of the sequence (rank order = sequence order). It runs its
block once from the state [0 | I] (chunk_rule.block_summary), which gives both the block's affine
summary (M, S) and, as a by-product of the same pass, its output's dependence on the incoming
state (Q̃); the summaries are exchanged (state_exchange.py) and the output is then
o = o(0) + Q̃ · S_in, one matmul. The local work never waits for another rank.
"""
from typing import Any
from hyper_parallel.core.context_parallel.linear_attention.checks import agree_delta_rule, check_delta_rule
from hyper_parallel.core.context_parallel.linear_attention.chunk_rule import block_summary
from hyper_parallel.core.context_parallel.linear_attention.state_exchange import incoming_state
from hyper_parallel.platform import get_platform


def cp_group(mesh_or_group: Any) -> Any:
    """The process group of a 1-D CP mesh, or the group itself."""
    get_group = getattr(mesh_or_group, "get_group", None)
    return get_group() if get_group is not None else mesh_or_group


def context_parallel_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, group: Any,
                                mode: str = "allgather", initial_state: Any = None, chunk_size: int = 64,
                                use_qk_l2norm: bool = True, scale: Any = None) -> Any:
    """This rank's output block (b, t_local, h_v, d_v) in v's dtype; arguments as in
    chunk_rule.chunk_delta_rule, each a rank's sequence block. ``group``: the CP group (or a
    1-D DeviceMesh). ``initial_state`` (optional) is the whole sequence's, the same on every rank."""
    group = cp_group(group)
    agree_delta_rule(group, q, k, v, g, beta, mode, chunk_size, initial_state, use_qk_l2norm, scale)
    check_delta_rule(q, k, v, g, beta, mode, chunk_size, initial_state)
    platform = get_platform()
    out0, reads, summary_s, summary_m = block_summary(q, k, v, g, beta, chunk_size, use_qk_l2norm, scale)
    if initial_state is None:
        initial = platform.zeros(summary_s.shape, dtype=summary_s.dtype, device=summary_s.device)
    else:
        initial = initial_state.to(summary_s.dtype)
    state_in = incoming_state(mode, summary_m, summary_s, initial, group)
    out = out0 + reads @ state_in
    return out.transpose(1, 2).to(v.dtype).contiguous()
