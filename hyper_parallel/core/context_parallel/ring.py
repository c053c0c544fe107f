"""Ring attention: K/V blocks travel rank to rank while each rank merges partial results by their
log-sum-exp, so no rank ever holds more than two K/V blocks (memory O(S/P)).

Forward, P steps: start sending the current K/V block to the next rank, attend the local queries
to it (skipping blocks wholly above the causal diagonal, the causal kernel on the diagonal), merge
in float32, then take the block that arrived. Backward recomputes each block's gradients from the
saved output and log-sum-exp; dK/dV accumulators travel with their blocks (P-1 hops, the last one
home), in the input dtype, so backward moves twice the forward bytes and keeps the same memory bound.
Both hops overlap compute: a step starts the next K/V hop before its kernels and takes the dK/dV
accumulator sent during the previous step only after them.

With ``zigzag`` each rank holds two sequence chunks (ids 2r and 2P-1-2r of 2P, see load_balance.py)
so every rank does the same causal work.
"""
from dataclasses import dataclass

from hyper_parallel.core.dtensor.ops.attention import expand_heads as _expand_heads
from hyper_parallel.core.dtensor.ops.attention import fold_heads as _fold_heads
from hyper_parallel.core.dtensor.ops.attention import merge_blocks as _merge
from hyper_parallel.platform import get_platform

SEQ = -2  # kernels see (batch, heads, seq, dim)


@dataclass(frozen=True)
class RingLayout:
    ranks: tuple       # global ranks in ring order
    index: int         # this rank's position
    zigzag: bool = False

    @property
    def size(self):
        return len(self.ranks)

    def chunk_ids(self, position):
        """Global ids of the sequence chunks held at ring ``position`` (in sub-chunk units)."""
        if self.zigzag:
            return (2 * position, 2 * self.size - 1 - 2 * position)
        return (position,)


def _relation(q_id, k_id, causal):
    if not causal or k_id < q_id:
        return "full"
    return "diag" if k_id == q_id else "skip"


class _Ring:
    """Neighbours and async block exchange on the ring."""

    def __init__(self, layout):
        self.layout = layout
        me, n = layout.index, layout.size
        self.next, self.prev = layout.ranks[(me + 1) % n], layout.ranks[(me - 1) % n]

    def start(self, tensors):
        platform = get_platform()
        return platform.p2p_exchange([(t, self.next) for t in tensors], [(t, self.prev) for t in tensors],
                                     async_op=True)


def _forward(ctx, q, k, v, layout, causal, scale):
    platform = get_platform()
    ring, n_sub = _Ring(layout), len(layout.chunk_ids(0))
    groups = q.shape[-3] // k.shape[-3]
    q_parts = q.chunk(n_sub, SEQ)
    my_ids = layout.chunk_ids(layout.index)
    acc = [None] * n_sub
    kv = (k.contiguous(), v.contiguous())
    for step in range(layout.size):
        holder = (layout.index - step) % layout.size
        pending = ring.start(kv) if step < layout.size - 1 else None
        k_parts, v_parts = kv[0].chunk(n_sub, SEQ), kv[1].chunk(n_sub, SEQ)
        for i, qi in enumerate(q_parts):
            for j, k_id in enumerate(layout.chunk_ids(holder)):
                relation = _relation(my_ids[i], k_id, causal)
                if relation == "skip":
                    continue
                out, lse = platform.attention_block_forward(
                    qi, _expand_heads(k_parts[j], groups), _expand_heads(v_parts[j], groups),
                    relation == "diag", scale)
                acc[i] = _merge(acc[i], out, lse)
        # drop every reference to the block just used (views, the finished send) before the next
        # exchange allocates its receive buffers: at most two blocks are alive at any time
        k_parts = v_parts = None
        if pending is not None:
            kv = tuple(pending.wait())
            pending = None
    out = platform.cat([a[0] for a in acc], SEQ % q.ndim).to(q.dtype)
    lse = platform.cat([a[1] for a in acc], -1)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.layout, ctx.causal, ctx.scale = layout, causal, scale
    return out


def _held_block_grads(ctx, parts, holder, kv):
    """(dq contributions per local chunk, dk, dv of the held block in the accumulator dtype) for
    one backward step; chunks a causal mask skips contribute None (dq) or zeros (dk/dv)."""
    platform = get_platform()
    q_parts, g_parts, out_parts, lse_parts = parts
    layout, causal, scale = ctx.layout, ctx.causal, ctx.scale
    groups, acc_dtype = q_parts[0].shape[-3] // kv[0].shape[-3], lse_parts[0].dtype
    n_sub = len(q_parts)
    my_ids = layout.chunk_ids(layout.index)
    k_parts, v_parts = kv[0].chunk(n_sub, SEQ), kv[1].chunk(n_sub, SEQ)
    dq, dk_parts, dv_parts = [None] * n_sub, [None] * n_sub, [None] * n_sub
    for i in range(n_sub):
        for j, k_id in enumerate(layout.chunk_ids(holder)):
            relation = _relation(my_ids[i], k_id, causal)
            if relation == "skip":
                continue
            dqi, dkj, dvj = platform.attention_block_backward(
                g_parts[i], q_parts[i], _expand_heads(k_parts[j], groups), _expand_heads(v_parts[j], groups),
                out_parts[i], lse_parts[i], relation == "diag", scale)
            # out of place: chunks are views in torch but copies in MindSpore
            dq[i] = _added(dq[i], dqi, acc_dtype)
            dk_parts[j] = _added(dk_parts[j], _fold_heads(dkj, groups), acc_dtype)
            dv_parts[j] = _added(dv_parts[j], _fold_heads(dvj, groups), acc_dtype)
    whole = []
    for grads, blocks in ((dk_parts, k_parts), (dv_parts, v_parts)):
        grads = [g if g is not None else b.new_zeros(b.shape, dtype=acc_dtype) for g, b in zip(grads, blocks)]
        whole.append(grads[0] if n_sub == 1 else platform.cat(grads, SEQ % kv[0].ndim))
    return dq, whole[0], whole[1]


def _added(acc, x, dtype):
    return x.to(dtype) if acc is None else acc + x


def _backward(ctx, grad_out):
    """Step s: start the K/V hop, compute the held block's gradients, then take the dK/dV
    accumulator that the previous rank sent at the end of its step s-1 (its hop overlapped this
    step's compute), add, and send the sum on without waiting; the last hop lands home."""
    platform = get_platform()
    q, k, v, out, lse = ctx.saved_tensors
    layout = ctx.layout
    ring, n_sub = _Ring(layout), len(layout.chunk_ids(0))
    acc_dtype = lse.dtype
    parts = (q.chunk(n_sub, SEQ), grad_out.contiguous().chunk(n_sub, SEQ), out.chunk(n_sub, SEQ),
             lse.chunk(n_sub, -1))
    dq = [None] * n_sub
    kv = (k.contiguous(), v.contiguous())
    own = hop = None
    for step in range(layout.size):
        pending = ring.start(kv) if step < layout.size - 1 else None
        dq_step, dk, dv = _held_block_grads(ctx, parts, (layout.index - step) % layout.size, kv)
        dq = [d if s is None else _added(d, s, acc_dtype) for d, s in zip(dq, dq_step)]
        # release the block just used (and its views) before the next exchange allocates
        dq_step = kv = None
        if step == 0:
            own = (dk, dv)
        else:
            if hop is not None:
                # drop the handle with the wait: it holds the finished send and receive buffers
                arrived, hop = hop.wait(), None
                dk, dv = dk + arrived[0], dv + arrived[1]
                arrived = None
            # the wire carries the input dtype: the accumulator's own dtype for float32/64 (exact), the
            # half dtype the gradient is returned in otherwise (one rounding per hop: see
            # docs/ring_attention.md, "Precision of the dK/dV hops")
            hop = ring.start((dk.to(k.dtype), dv.to(v.dtype)))
        dk = dv = None
        if pending is not None:
            kv = tuple(pending.wait())
            pending = None
    dk, dv = own
    if hop is not None:
        arrived, hop = hop.wait(), None
        dk, dv = dk + arrived[0], dv + arrived[1]
    grad_q = platform.cat([d if d is not None else p.new_zeros(p.shape) for d, p in zip(dq, parts[0])],
                          SEQ % q.ndim).to(q.dtype)
    return grad_q, dk.to(k.dtype), dv.to(v.dtype), None, None, None


_ring_fn = get_platform().make_autograd_function("RingAttention", _forward, _backward)


def ring_attention(q, k, v, layout, causal=False, scale=None):
    """Attention of local queries against the K/V blocks of every rank in ``layout``'s ring.

    q, k, v: this rank's (batch, heads, seq, dim) blocks (k/v may have fewer heads: GQA)."""
    if q.shape[-3] % k.shape[-3]:
        raise ValueError(f"ring attention: {q.shape[-3]} query heads are not a multiple of {k.shape[-3]} "
                         f"key/value heads")
    return _ring_fn(q, k, v, layout, causal, scale)
