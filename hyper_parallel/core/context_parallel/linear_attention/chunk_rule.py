"""The chunked gated delta rule on one device, written once for every framework.

The recurrence (state S is d_k × d_v per head, one token t at a time):
    S_t = (I − β_t k_t k_tᵀ) · D_t · S_{t−1} + β_t k_t v_tᵀ,      o_t = S_tᵀ q_t
with D_t = exp(g_t): a scalar per head (Gated DeltaNet: Qwen3-Next, Qwen3.5) or a diagonal over the
d_k channels (Kimi Delta Attention). q and k are l2-normalised and q is scaled by d_k^−½, as in the
reference kernels (transformers' torch_chunk_gated_delta_rule / chunk_kimi_delta_attention).

Chunked form (chunk length C): inside a chunk the C delta updates collapse into one unit-lower
triangular solve (the UT transform), so the only sequential part is one small step per chunk.

The map from the incoming state to everything the block produces is affine, which is what context
parallelism uses (``block_summary``): run the block once with the value widened by d_k zero
columns and the incoming state [0 | I]; the first d_v columns are the block's output and final
state from a zero state, the last d_k columns are Q̃ (o_t = o_t(0) + Q̃_t · S_in) and
M (S_out = M · S_in + S_out(0)).
"""
from typing import Any
from dataclasses import dataclass

from hyper_parallel.platform import get_platform

L2_EPS = 1e-6


@dataclass
class Chunks:
    """A block in chunks, (batch, heads, n_chunks, C, ...), everything the scan over chunks reads."""
    u: object          # T · (β v): the values the UT transform makes of the chunk
    w: object          # T · (β k ⊙ exp(G)): how much each token's value the incoming state predicts
    q_decayed: object  # q ⊙ exp(G): reads the incoming state
    k_decayed: object  # k ⊙ exp(G_last − G): writes the chunk's updates into the outgoing state
    intra: object      # (C, C) causal q·k within the chunk, decayed
    decay: object      # exp(G_last): the whole chunk's decay of the incoming state, broadcast-ready
    length: int        # tokens before the chunk padding


def l2_normalise(x: Any) -> Any:
    return x * ((x * x).sum(dim=-1, keepdim=True) + L2_EPS).rsqrt()


def to_heads_first(q: Any, k: Any, v: Any, g: Any, beta: Any, use_qk_l2norm: Any, scale: Any) -> Any:
    """(b, t, h, d) inputs -> (b, h, t, d) in the compute dtype; GQA k heads repeated, q scaled."""
    platform = get_platform()
    dtype = platform.compute_dtype(v.dtype)
    groups = v.shape[2] // k.shape[2]
    if groups > 1:   # each q/k head serves ``groups`` consecutive value heads (the reference's order)
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype).contiguous() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalise(q), l2_normalise(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def _pad_to_chunks(x, chunk, seq_dim):
    """``x`` zero-padded along ``seq_dim`` to a multiple of ``chunk``, then split into chunks there.
    A padded token has k = 0, β = 0 and g = 0: it leaves the state unchanged."""
    length = x.shape[seq_dim]
    pad = (-length) % chunk
    if pad:
        shape = list(x.shape)
        shape[seq_dim] = pad
        x = get_platform().cat([x, get_platform().zeros(shape, dtype=x.dtype, device=x.device)], dim=seq_dim)
    shape = list(x.shape)
    shape[seq_dim:seq_dim + 1] = [shape[seq_dim] // chunk, chunk]
    return x.reshape(shape)


def _causal_masks(chunk, device):
    ar = get_platform().arange(chunk, device=device)
    return ar.unsqueeze(0) > ar.unsqueeze(1)     # strictly above the diagonal: a later key


def _intra_products(q, k, k_beta, cum_g, per_channel, above):
    """(UT system, causal q·k) of every chunk, each pair (i, j ≤ i) decayed by exp(G_i − G_j)."""
    if per_channel:
        # per-channel decay cannot be factored out of the dot product: the sum runs over d_k
        log_decay = cum_g.unsqueeze(-2) - cum_g.unsqueeze(-3)
        decay = log_decay.masked_fill(above.unsqueeze(-1), float("-inf")).exp()
        system = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1)
        intra = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1)
        return system, intra.masked_fill(above, 0.0)
    decay = (cum_g.unsqueeze(-1) - cum_g.unsqueeze(-2)).masked_fill(above, float("-inf")).exp()
    return (k_beta @ k.transpose(-1, -2)) * decay, (q @ k.transpose(-1, -2)) * decay


def chunk_block(q: Any, k: Any, v: Any, g: Any, beta: Any, chunk: Any) -> Any:
    """Chunks of one block given in heads-first layout (``to_heads_first``)."""
    platform = get_platform()
    per_channel = g.dim() == q.dim()
    length = q.shape[2]
    q, k, v = (_pad_to_chunks(x, chunk, 2) for x in (q, k, v))
    g, beta = _pad_to_chunks(g, chunk, 2), _pad_to_chunks(beta, chunk, 2)
    cum_g = g.cumsum(dim=3)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    above = _causal_masks(chunk, q.device)
    system, intra = _intra_products(q, k, k_beta, cum_g, per_channel, above)
    g_tok = cum_g if per_channel else cum_g.unsqueeze(-1)
    last = g_tok[..., -1:, :]
    solved = platform.solve_unit_lower(system, platform.cat([v_beta, k_beta * g_tok.exp()], dim=-1))
    d_v = v.shape[-1]
    decay = last.exp().transpose(-1, -2) if per_channel else last.exp()
    return Chunks(u=solved[..., :d_v], w=solved[..., d_v:], q_decayed=q * g_tok.exp(),
                  k_decayed=k * (last - g_tok).exp(), intra=intra, decay=decay, length=length)


def scan(chunks: Any, state: Any) -> Any:
    """(output (b, h, t, width), final state) of the chunks from ``state`` (b, h, d_k, width).
    ``width`` may exceed d_v: extra state columns see zero values (``block_summary``)."""
    platform = get_platform()
    u = chunks.u
    extra = state.shape[-1] - u.shape[-1]
    if extra:
        u = platform.cat([u, platform.zeros(u.shape[:-1] + (extra,), dtype=u.dtype, device=u.device)], dim=-1)
    outputs = []
    for n in range(u.shape[2]):
        fresh = u[:, :, n] - chunks.w[:, :, n] @ state         # the part the state does not predict
        outputs.append(chunks.q_decayed[:, :, n] @ state + chunks.intra[:, :, n] @ fresh)
        state = state * chunks.decay[:, :, n] + chunks.k_decayed[:, :, n].transpose(-1, -2) @ fresh
    out = platform.cat(outputs, dim=2)
    return out[:, :, :chunks.length], state


def chunk_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, initial_state: Any = None,
                     chunk_size: int = 64, use_qk_l2norm: bool = True, scale: Any = None) -> Any:
    """The single-device rule: (output (b, t, h_v, d_v) in v's dtype, final state (b, h_v, d_k, d_v)).

    q, k: (b, t, h_k, d_k); v: (b, t, h_v, d_v); g: (b, t, h_v) log-decay per head (GDN) or
    (b, t, h_v, d_k) per channel (KDA); beta: (b, t, h_v); initial_state: (b, h_v, d_k, d_v) or None."""
    platform = get_platform()
    q, k, v_h, g, beta = to_heads_first(q, k, v, g, beta, use_qk_l2norm, scale)
    b, h, _, d_k = k.shape
    if initial_state is None:
        state = platform.zeros((b, h, d_k, v_h.shape[-1]), dtype=v_h.dtype, device=v_h.device)
    else:
        state = initial_state.to(v_h.dtype)
    out, state = scan(chunk_block(q, k, v_h, g, beta, chunk_size), state)
    return out.transpose(1, 2).to(v.dtype).contiguous(), state


def block_summary(q: Any, k: Any, v: Any, g: Any, beta: Any, chunk_size: Any, use_qk_l2norm: bool = True,
                  scale: Any = None) -> Any:
    """One pass over this rank's block from the state [0 | I]:
    (o0 (b, h, t, d_v), Q̃ (b, h, t, d_k), S0 (b, h, d_k, d_v), M (b, h, d_k, d_k)), all heads-first."""
    platform = get_platform()
    q, k, v, g, beta = to_heads_first(q, k, v, g, beta, use_qk_l2norm, scale)
    b, h, _, d_k = k.shape
    d_v = v.shape[-1]
    ar = platform.arange(d_k, device=v.device)
    eye = (ar.unsqueeze(1) == ar.unsqueeze(0)).to(v.dtype).expand(b, h, d_k, d_k)
    start = platform.cat([platform.zeros((b, h, d_k, d_v), dtype=v.dtype, device=v.device), eye], dim=-1)
    out, final = scan(chunk_block(q, k, v, g, beta, chunk_size), start)
    return out[..., :d_v], out[..., d_v:], final[..., :d_v], final[..., d_v:]
