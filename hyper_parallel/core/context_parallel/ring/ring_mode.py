"""ContextParallel with ``kv_exchange="ring"``: Ulysses on the ds dims (if any), then ring attention
over the remaining sequence dim instead of all-gathering K/V.

The user's module is called with q, k, v as DTensors, as in every mode; a dispatch interceptor
(core/dtensor/dispatch/interceptors.py) follows them through the module's relayouts (transpose, view...)
and, at ``F.scaled_dot_product_attention`` or ``hyper_parallel.attention`` (soft-capping, sinks, a
window: the ring's block kernels take them), runs the ring kernel on their local blocks instead of
the attention rule. Attention code that consumes them otherwise is refused: it cannot be ringed."""
from typing import Any
from hyper_parallel.core.agreement_attention import agree_on_attention
from hyper_parallel.core.context_parallel.movement import to_mode
from hyper_parallel.core.context_parallel.load_balance import merge_head_tail, zigzag_block, zigzag_halves
from hyper_parallel.core.context_parallel.output import first_output, to_caller
from hyper_parallel.core.context_parallel.masks.masked_ring import masked_ring_attention
from hyper_parallel.core.context_parallel.masks.attention_masks import active_masks
from hyper_parallel.core.context_parallel.ring.ring_attention import RingLayout, ring_attention
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.dispatch.interceptors import Interceptor, intercepting
from hyper_parallel.core.attention.offset_causal import ARG_NAMES
from hyper_parallel.core.attention.roles import SeqTracking
from hyper_parallel.core.dtensor.ops.attention_variants import call_variant, local_sinks
from hyper_parallel.core.dtensor.ops.registry import OpStrategy


class RingInterceptor(SeqTracking, Interceptor):
    """Follows q, k, v to the attention op and runs ``kernel(q, k, v, variant, sinks)`` there
    (their sequence dim tracked and checked there, core/attention/roles.py)."""
    pass_through = frozenset({"transpose", "permute", "movedim", "t", "view", "identity", "cast", "expand",
                              "contiguous"})
    consumers = frozenset({"sdpa", "attention", "npu_fusion_attention"})

    def __init__(self, kernel: Any) -> None:
        super().__init__()
        self.kernel = kernel
        self.used = False

    def strategy(self, call: Any) -> Any:
        self.check_kernel(call)   # seq_dim must reach the kernel's sequence dim
        if call.name not in ("sdpa", "attention"):
            return None  # the NPU rule explains that sequence-split K/V needs the sdpa ring
        q, k, v = (call.arg(i, ARG_NAMES[i]) for i in range(3))
        if not all(self.follows(t) for t in (q, k, v)):
            return None
        agree_on_attention(call)   # every rank's settings alike before one rank refuses them
        if call.name == "sdpa" and (call.arg(3, "attn_mask") is not None
                                    or (call.arg(4, "dropout_p", 0.0) or 0.0) > 0):
            raise ValueError("ring attention supports is_causal=True/False without attn_mask or dropout; "
                             "use kv_exchange='allgather' for explicit masks")
        variant, sinks = call_variant(call)
        sinks = local_sinks(sinks, call.spec(q))
        placements = [call.spec(t).placements for t in (q, k, v)]
        inputs = [None] * len(call.specs)
        for t, p in zip((q, k, v), placements):
            inputs[call.index(t)] = p
        self.used = True

        def local(call_, args, kwargs):
            values = [args[i] if i < len(args) else kwargs.get(ARG_NAMES[i]) for i in range(3)]
            return self.kernel(*values, variant, sinks)
        return OpStrategy(inputs=inputs, outputs=placements[0], local=local)

    def refusal(self, name: str) -> Any:
        return ValueError(f"ContextParallel(kv_exchange='ring') cannot ring the attention code in this "
                          f"module: q/k/v reach '{name}'. Write the attention with "
                          f"F.scaled_dot_product_attention (or the NPU fused kernel), or use "
                          f"kv_exchange='allgather'.")


def _ring_kernel(layout, masks):
    """kernel(q, k, v, variant, sinks): the plain ring, or the masked ring under ``attention_masks``."""
    def kernel(q, k, v, variant, sinks):
        if masks is None:
            return ring_attention(q, k, v, layout, variant.causal, variant.scale, variant.softcap,
                                  variant.window, sinks)
        return masked_ring_attention(q, k, v, layout, masks, variant.causal, variant.scale, variant.softcap,
                                     sinks, variant.window)
    return kernel


def run_ring(style: Any, inputs: Any, ulysses_dims: Any, ring_dim: Any, call: Any) -> Any:
    """(this rank's contiguous output block (local, differentiable), the output's seq dim, its
    placements on the working mesh)."""
    mesh, seq, head = inputs.mesh, inputs.seq, inputs.head
    locals_ = inputs.locals
    if style.load_balance:
        # zigzag: this rank holds chunks 2r and 2P-1-2r of q, k and v (the DTensor layout below is
        # only used to move heads; the ring kernel knows the true chunk ids)
        locals_ = [zigzag_block(t, seq, head, mesh, ring_dim) for t in locals_]
    layout = RingLayout(mesh.group_ranks(ring_dim), mesh.get_local_rank(ring_dim), style.load_balance)
    dts = [DTensor.from_local(t, mesh, p, shape=s)
           for t, p, s in zip(locals_, inputs.placements, inputs.shapes)]
    masks = active_masks()   # packed documents / padding (masks.py): the masked ring kernel
    ring = RingInterceptor(_ring_kernel(layout, masks))
    # one all-to-all per tensor, not fused: a fused one stages q, k and v of the rank at once,
    # beyond the ring's memory bound (two K/V blocks and the re-laid own block)
    moved = to_mode(dts, seq, head, ulysses_dims, [], fuse=False)
    ring.track(moved, seq, f"ContextParallel(seq_dim={style.seq_dim}, head_dim={style.head_dim})")
    with intercepting(ring):
        out = first_output(call(*moved))
    if not ring.used:
        raise ValueError("ContextParallel(kv_exchange='ring'): the module never called "
                         "F.scaled_dot_product_attention on q, k, v, so nothing was ringed")
    out_local, out_seq, placements = to_caller(out, inputs, ulysses_dims)
    if style.load_balance:
        same_layout = out_local.ndim == len(inputs.shapes[0])
        head_out, tail_out = zigzag_halves(out_local, out_seq, head if same_layout else None)
        out_local = merge_head_tail(head_out, tail_out, out_seq, mesh, ring_dim)
    return out_local, out_seq, placements
