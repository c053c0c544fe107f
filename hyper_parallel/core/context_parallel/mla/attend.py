"""Attention of this rank's queries against keys/values the caller already holds whole.

MLA's latent path (latent.py) gathers the compressed latent and up-projects K/V on every rank, so
K/V arrive here global and q as this rank's contiguous block: the all-gather-KV layout, reached
without the K/V all-gather. The attention then runs through the same DTensor kernel rule as
ContextParallel's all-gather mode (mode.py), with the same pieces: q a Shard(seq) DTensor (the
rule applies the global causal offset of this rank's rows), K/V Replicate with their gradient
taken as Partial (each rank's queries contribute a share; the latent gather's reduce-scatter sums
them exactly once), ``attention_masks`` padding / documents through the mask interceptor, and
``load_balance`` through the head-tail exchange of q halves and their outputs.

Ranks that disagree (SPEC §19): before anything moves, the ranks compare load_balance, the masks
(entered or not, shapes, documents), q/k/v's dtype and shape, grad mode; the attention kernel
inside then compares its own settings (sdpa's is_causal / scale / dropout_p / attn_mask,
``hyper_parallel.attention``'s softcap / window / sinks) through ``attention_call``, as under
ContextParallel. Both are core/agreement.py's checks, at the call site named by ``call``'s code.
"""
from typing import Any
from hyper_parallel.core.agreement import check_agreement
from hyper_parallel.core.agreement_attention import attention_call
from hyper_parallel.core.context_parallel.checks import mask_settings
from hyper_parallel.core.context_parallel.masks.attention_masks import check_masks
from hyper_parallel.core.context_parallel.masks.mask_mode import with_masks
from hyper_parallel.core.context_parallel.mode import _Inputs, _load_balanced
from hyper_parallel.core.context_parallel.output import first_output, to_caller
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.attention.roles import AttentionRoles, expecting
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard

SEQ, HEAD = 2, 1   # (batch, heads, seq, dim)
LABEL = "MLA latent all-gather attention"
_FIX = ("call the MLA layer alike on every CP rank (same load_balance, attention_masks, attention settings "
        "and shapes)")


def _agree(mesh, q, k, v, load_balance, masks, site):
    """ValueError on every CP rank unless all run this call alike (before the first collective)."""
    from hyper_parallel.platform import get_platform
    settings = dict(mask_settings(masks))
    settings.update({"load_balance": bool(load_balance),
                     "q/k/v (dtype, shape)": tuple((str(x.dtype), tuple(int(s) for s in x.shape))
                                                   for x in (q, k, v)),
                     "grad mode (is_grad_enabled)": bool(get_platform().is_grad_enabled())})
    check_agreement(mesh, LABEL, settings, signature=("MLA", site), fix=_FIX)


def _inputs(mesh, q, k, v):
    """The all-gather-KV inputs as mode.py describes them: q's block of a global sequence."""
    total = k.shape[SEQ]
    if q.shape[SEQ] * mesh.size() != total:
        raise ValueError(f"attend_gathered: q holds {q.shape[SEQ]} tokens, k/v {total}; on {mesh.size()} CP "
                         f"ranks q must be this rank's block of the gathered sequence")
    shapes = [tuple(q.shape[:SEQ]) + (total,) + tuple(q.shape[SEQ + 1:]), tuple(k.shape), tuple(v.shape)]
    placements = [(Shard(SEQ),), (Replicate(),), (Replicate(),)]
    return _Inputs(mesh, [0], [q, k, v], placements, shapes, "plain", SEQ, HEAD)


def attend_gathered(q: Any, k: Any, v: Any, mesh: Any, call: Any, load_balance: bool = False,
                    masks: Any = None) -> Any:
    """``call(q, k, v)`` (DTensors in, the attention's output DTensor out) for this rank's query
    block ``q`` (B, H, L, D) and the whole sequence's ``k``, ``v`` (B, H, P·L, D), plain tensors
    whose gradient is this rank's share. Returns this rank's contiguous block of the output, in
    the layout the call returns (e.g. BSHD)."""
    if mesh.ndim != 1:
        raise ValueError(f"attend_gathered: needs the 1-D CP mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}")
    # the call site: the code of ``call`` (one per model's attention; a fresh closure per call has
    # the same code), so each site's settings sequence is remembered (core/agreement.py)
    site = getattr(call, "__code__", type(call))
    _agree(mesh, q, k, v, load_balance, masks, site)
    inputs = _inputs(mesh, q, k, v)
    kv = [DTensor.from_local(t, mesh, [Replicate()], shape=tuple(t.shape), grad_placements=[Partial()])
          for t in (k, v)]
    if masks is not None:   # an AttentionMasks (attention_masks(...) yields it) of the global sequence
        check_masks(masks, q.shape[0], inputs.shapes[0][SEQ], k.shape[SEQ])
        call = with_masks(masks, call)
    roles = AttentionRoles(mesh, ((0, "seq"),), inputs.shapes[0][SEQ], LABEL)

    def promised(*args):
        with expecting(roles), attention_call(mesh, LABEL, ("MLA", site)):
            return call(*args)
    if load_balance:
        if q.shape[SEQ] % 2:
            raise ValueError(f"load_balance=True: the local sequence length {q.shape[SEQ]} is odd; it must "
                             f"split into two equal halves")
        return _load_balanced(inputs, kv[0], kv[1], promised)[0]
    q_dt = DTensor.from_local(q, mesh, [Shard(SEQ)], shape=inputs.shapes[0])
    return to_caller(first_output(promised(q_dt, kv[0], kv[1])), inputs, [])[0]
