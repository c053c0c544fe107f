"""ContextParallel with ``kv_exchange="ring"``: Ulysses on the ds dims (if any), then ring attention
over the remaining sequence dim instead of all-gathering K/V."""
from hyper_parallel.core.context_parallel.layouts import mode_placements
from hyper_parallel.core.context_parallel.load_balance import merge_head_tail, split_head_tail
from hyper_parallel.core.context_parallel.output import to_caller
from hyper_parallel.core.context_parallel.ring import RingLayout, ring_attention
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.ops.attention import ring_attention_kernel
from hyper_parallel.platform import get_platform


def run_ring(style, inputs, ulysses_dims, ring_dim, call):
    """(this rank's contiguous output block (local, differentiable), the output's seq dim, its
    placements on the working mesh)."""
    from hyper_parallel.core.context_parallel.mode import first_output
    mesh, seq, head = inputs.mesh, inputs.seq, inputs.head
    ndim = inputs.locals[0].ndim
    locals_ = inputs.locals
    if style.load_balance:
        # zigzag: this rank holds chunks 2r and 2P-1-2r of q, k and v (the DTensor layout below is
        # only used to move heads; the ring kernel knows the true chunk ids)
        locals_ = [get_platform().cat(split_head_tail(t, seq, mesh, ring_dim), seq) for t in locals_]
    layout = RingLayout(mesh.group_ranks(ring_dim), mesh.get_local_rank(ring_dim), style.load_balance)
    dts = [DTensor.from_local(t, mesh, p, shape=s) for t, p, s in zip(locals_, inputs.placements, inputs.shapes)]
    target, _ = mode_placements(inputs.placements[0], mesh, ndim, seq, head, ulysses_dims, [])
    moved = []
    for t in dts:
        t = t.redistribute(placements=target)  # our own object either way: safe to mark
        t._hp_ring = True
        moved.append(t)
    used = []

    def kernel(q, k, v, causal, scale):
        used.append(True)
        return ring_attention(q, k, v, layout, causal, scale)
    with ring_attention_kernel(kernel):
        out = first_output(call(*moved))
    if not used:
        raise ValueError("ContextParallel(kv_exchange='ring'): the module never called "
                         "F.scaled_dot_product_attention on q, k, v, so nothing was ringed")
    out_local, out_seq, placements = to_caller(out, inputs, ulysses_dims)
    if style.load_balance:
        head_out, tail_out = out_local.chunk(2, out_seq)
        out_local = merge_head_tail(head_out, tail_out, out_seq, mesh, ring_dim)
    return out_local, out_seq, placements
