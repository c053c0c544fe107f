"""Ring attention: K/V blocks travel rank to rank while each rank merges partial results by their
log-sum-exp, so no rank ever holds more than two K/V blocks (memory O(S/P)).

One loop serves every ring: what runs on a (local query chunk, visiting key chunk) pair is a
*block kernel* given the pair's global positions. ``CausalBlocks`` (core/attention/causal_blocks.py)
skips chunks wholly above the causal diagonal and runs the kernel's causal mask on the diagonal;
``MaskedBlocks`` (masked_ring.py) runs the tiled masked kernel of ``attention_masks`` and skips the
tiles a document boundary, padding or the diagonal empties. A kernel returns None for a pair it skips.

Forward, P steps: start sending the current K/V block to the next rank, attend the local queries
to it, merge in float32, then take the block that arrived. Backward recomputes each block's
gradients from the saved output and log-sum-exp; dK/dV accumulators travel with their blocks (P-1
hops, the last one home), in the input dtype, so backward moves twice the forward bytes and keeps
the same memory bound. Both hops overlap compute: a step starts the next K/V hop before its kernels
and takes the dK/dV accumulator sent during the previous step only after them.

The ring runs once per group of K/V heads (``HEAD_GROUPS``, see ``_head_ranges``): every per-step
buffer (the two K/V blocks, the dK/dV hop's send and receive buffers, the kernel's outputs, the
own block's dK/dV) then covers half the heads, which keeps a rank's peak memory at about twice
single-device attention for any P; the bytes sent are the same, in twice the messages. Large
blocks run four groups (``_group_count``: 1.4-1.5x single-device), where the messages stay large
enough that their number costs no time.

With ``zigzag`` each rank holds two sequence chunks (ids 2r and 2P-1-2r of 2P, see load_balance.py)
so every rank does the same causal work.

A sliding window (the kernels' ``window``) skips the kernel of every chunk pair outside it; on the
contiguous ring it also shortens the ring to the blocks the window reaches (``ring_steps``): fewer
steps, fewer K/V hops, and the dK/dV accumulators go straight home from the last one.
"""
from typing import Any
from dataclasses import dataclass

from hyper_parallel.core.autograd_functions import lazy_autograd_function
from hyper_parallel.core.attention.block_masks import Span
from hyper_parallel.core.attention.causal_blocks import CausalBlocks
from hyper_parallel.core.attention.lse import fold_sinks, sinks_grad
from hyper_parallel.platform import get_platform

SEQ, HEADS = -2, -3  # kernels see (batch, heads, seq, dim); the log-sum-exp is (batch, heads, seq)
HEAD_GROUPS = 2      # rings per call, each on a slice of the K/V heads (one ring for a single K/V head)
# ...and twice as many once each group's K block is still this large: the per-step buffers halve
# again, while the messages stay large enough that their count costs nothing measurable
LARGE_GROUP_BYTES = 2 << 20


@dataclass(frozen=True)
class RingLayout:
    ranks: tuple       # global ranks in ring order
    index: int         # this rank's position
    zigzag: bool = False

    @property
    def size(self) -> int:
        return len(self.ranks)

    def chunk_ids(self, position: Any) -> Any:
        """Global ids of the sequence chunks held at ring ``position`` (in sub-chunk units)."""
        if self.zigzag:
            return (2 * position, 2 * self.size - 1 - 2 * position)
        return (position,)

    def spans(self, position: Any, length: Any) -> Any:
        """Global spans of the chunks held at ``position`` when each rank's block is ``length`` long."""
        ids = self.chunk_ids(position)
        size = length // len(ids)
        return [Span(i * size, size) for i in ids]


class QueryHeadChunks:
    """A block kernel run on chunks of the query heads in turn, all sharing the one K/V head of the
    block (MQA, where the ring cannot split into K/V head groups). A kernel that repeats the K/V block
    to every query head (``repeats_kv``) then repeats it to a chunk's heads only, and its dq, dk, dv
    cover a chunk: the per-step buffers that are per query head shrink, while the K/V block, its hops
    and the bytes sent stay as they are (each step runs ``HEAD_GROUPS`` kernel calls instead of one)."""

    def __init__(self, inner: Any, heads: Any) -> None:
        self.inner, self.merge, self.empty = inner, inner.merge, inner.empty
        self.causal, self.window = getattr(inner, "causal", False), getattr(inner, "window", None)
        size = -(-heads // HEAD_GROUPS)
        self.ranges = [(start, min(size, heads - start)) for start in range(0, heads, size)]

    def _chunks(self, t, heads_dim=HEADS):
        return [t.narrow(heads_dim % t.ndim, start, count) for start, count in self.ranges]

    def forward(self, q: Any, k: Any, v: Any, q_span: Any, k_span: Any) -> Any:
        results = [self.inner.forward(qc, k, v, q_span, k_span) for qc in self._chunks(q)]
        if results[0] is None:
            return None
        return _cat([r[0] for r in results], HEADS, q), _cat([r[1] for r in results], -2, results[0][1])

    def backward(self, grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, q_span: Any,
                 k_span: Any) -> Any:
        dq, dk, dv = [], None, None
        for g, qc, oc, lc in zip(*(self._chunks(t) for t in (grad_out, q, out)), self._chunks(lse, -2)):
            got = self.inner.backward(g, qc, k, v, oc, lc, q_span, k_span)
            if got is None:
                return None
            dq.append(got[0])
            # summed in the accumulator dtype (a half-precision chunk share is rounded once by the kernel)
            dk, dv = _added(dk, got[1], lse.dtype), _added(dv, got[2], lse.dtype)
            got = None
        return _cat(dq, HEADS, q), dk, dv


def _shared_kv(kernel, q, k):
    """``kernel``, or its query-head chunks where the K/V block is one head repeated to several."""
    if k.shape[HEADS] == 1 and q.shape[HEADS] > 1 and getattr(kernel, "repeats_kv", False):
        return QueryHeadChunks(kernel, q.shape[HEADS])
    return kernel


class _Ring:
    """Neighbours and async block exchange on the ring."""

    def __init__(self, layout):
        self.layout = layout
        me, n = layout.index, layout.size
        self.next, self.prev = layout.ranks[(me + 1) % n], layout.ranks[(me - 1) % n]

    def start(self, tensors, distance=1):
        """Send ``tensors`` ``distance`` ranks on, receive the same from ``distance`` ranks back."""
        layout, platform = self.layout, get_platform()
        to = layout.ranks[(layout.index + distance) % layout.size]
        source = layout.ranks[(layout.index - distance) % layout.size]
        return platform.p2p_exchange([(t, to) for t in tensors], [(t, source) for t in tensors],
                                     async_op=True)


def ring_steps(layout: Any, kernel: Any, length: Any) -> Any:
    """How many ring steps a call takes: every rank's block (P), or under a sliding window on the
    contiguous ring only the blocks the window reaches — the own block and the ceil((w - 1) / L)
    before it (L = ``length``, the local block) — so the hops past them are never sent. Every rank
    takes the same number of steps (its exchanges pair up). Zigzag keeps P: a rank's two chunks
    need the chunks of ranks far apart on the ring."""
    window = getattr(kernel, "window", None)
    if window is None or layout.zigzag or not getattr(kernel, "causal", False):
        return layout.size
    return min(layout.size, 1 + -(-(window - 1) // length))


def _cat(pieces, dim, like):
    return pieces[0] if len(pieces) == 1 else get_platform().cat(pieces, dim % like.ndim)


def _added(acc, x, dtype):
    return x.to(dtype) if acc is None else acc + x


def _group_count(k):
    """HEAD_GROUPS, doubled where each of twice as many groups still sends a K block of at least
    LARGE_GROUP_BYTES (every rank of a ring holds the same shapes, so all choose alike)."""
    group_bytes = k.nbytes // (2 * HEAD_GROUPS)   # .nbytes: torch and MindSpore tensors alike
    return 2 * HEAD_GROUPS if group_bytes >= LARGE_GROUP_BYTES else HEAD_GROUPS


def _head_ranges(kv_heads, wanted=HEAD_GROUPS):
    """(first K/V head, count) of each of ``wanted`` head groups the ring runs on in turn. An odd
    count splits unevenly, the larger group first: it then runs with nothing waiting beside it, and
    the smaller group's ring, beside the first group's finished gradients, stays below it."""
    groups = min(wanted, kv_heads)
    bounds = [-(-kv_heads * g // groups) for g in range(groups + 1)]
    return [(bounds[g], bounds[g + 1] - bounds[g]) for g in range(groups)]


def _per_head_group(q, k, tensors, run):
    """``run`` on the slices of ``tensors`` (q-shaped, k-shaped or lse-shaped, told by their head
    count) for each head group; the results' pieces concatenated along the heads."""
    groups = q.shape[HEADS] // k.shape[HEADS]
    results = []
    for start, count in _head_ranges(k.shape[HEADS], _group_count(k)):
        sliced = []
        for t in tensors:
            dim = t.ndim + (HEADS if t.ndim == q.ndim else HEADS + 1)
            per_head = groups if t.shape[dim] == q.shape[HEADS] else 1
            sliced.append(t.narrow(dim, start * per_head, count * per_head))
        results.append(run(*sliced))
        sliced = None
    return [_cat([r[i] for r in results], HEADS if results[0][i].ndim == q.ndim else -2, results[0][i])
            for i in range(len(results[0]))]


def _ring_forward(layout, kernel, q, k, v):
    """(out in q's dtype, lse) of this rank's queries against every rank's K/V block."""
    ring, length = _Ring(layout), q.shape[SEQ]
    mine = layout.spans(layout.index, length)
    q_parts = q.chunk(len(mine), SEQ % q.ndim)
    acc = [None] * len(mine)
    kv = (k.contiguous(), v.contiguous())
    steps = ring_steps(layout, kernel, length)
    for step in range(steps):
        pending = ring.start(kv) if step < steps - 1 else None
        visiting = layout.spans((layout.index - step) % layout.size, length)
        k_parts, v_parts = (t.chunk(len(visiting), SEQ % t.ndim) for t in kv)
        for i, q_span in enumerate(mine):
            for j, k_span in enumerate(visiting):
                got = kernel.forward(q_parts[i], k_parts[j], v_parts[j], q_span, k_span)
                if got is not None:
                    acc[i] = kernel.merge(acc[i], *got)
        # drop every reference to the block just used (views, the finished send) before the next
        # exchange allocates its receive buffers: at most two blocks are alive at any time
        k_parts = v_parts = got = None
        if pending is not None:
            kv = tuple(pending.wait())
            pending = None
    acc = [a if a is not None else kernel.empty(p, v) for a, p in zip(acc, q_parts)]
    return _cat([a[0] for a in acc], SEQ, q).to(q.dtype), _cat([a[1] for a in acc], -1, acc[0][1])


def _forward(ctx, q, k, v, sinks, layout, kernel):
    out, lse = _per_head_group(q, k, (q, k, v), lambda *t: _ring_forward(layout, kernel, *t))
    if sinks is not None:   # the sink logits join the merged denominator once, after every block
        out, lse = fold_sinks(out, lse, sinks)
        out = out.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
    ctx.layout, ctx.kernel = layout, kernel
    return out


def _held_block_grads(kernel, parts, visiting, kv):
    """(dq contributions per local chunk, dk, dv of the held block in the accumulator dtype) for
    one backward step; chunks the kernel skips contribute None (dq) or zeros (dk/dv)."""
    q_parts, g_parts, out_parts, lse_parts, mine = parts
    acc_dtype = lse_parts[0].dtype
    k_parts, v_parts = (t.chunk(len(visiting), SEQ % t.ndim) for t in kv)
    dq, dk_parts, dv_parts = [None] * len(mine), [None] * len(visiting), [None] * len(visiting)
    for i, q_span in enumerate(mine):
        for j, k_span in enumerate(visiting):
            got = kernel.backward(g_parts[i], q_parts[i], k_parts[j], v_parts[j], out_parts[i], lse_parts[i],
                                  q_span, k_span)
            if got is None:
                continue
            # out of place: chunks are views in torch but copies in MindSpore
            dq[i] = _added(dq[i], got[0], acc_dtype)
            dk_parts[j] = _added(dk_parts[j], got[1], acc_dtype)
            dv_parts[j] = _added(dv_parts[j], got[2], acc_dtype)
    whole = []
    for grads, blocks in ((dk_parts, k_parts), (dv_parts, v_parts)):
        grads = [g if g is not None else b.new_zeros(b.shape, dtype=acc_dtype) for g, b in zip(grads, blocks)]
        whole.append(_cat(grads, SEQ, blocks[0]))
    return dq, whole[0], whole[1]


def _ring_backward(layout, kernel, q, k, v, out, lse, grad_out):
    """Step s: start the K/V hop, compute the held block's gradients, then take the dK/dV
    accumulator that the previous rank sent at the end of its step s-1 (its hop overlapped this
    step's compute), add, and send the sum on without waiting; the last hop lands home (with fewer
    steps than ranks, ``ring_steps``, it goes straight home: steps - 1 ranks back)."""
    ring, length = _Ring(layout), q.shape[SEQ]
    mine = layout.spans(layout.index, length)
    n = len(mine)
    parts = tuple(t.chunk(n, SEQ % t.ndim) for t in (q, grad_out.contiguous(), out))
    parts += (lse.chunk(n, -1), mine)
    acc_dtype = lse.dtype
    dq = [None] * n
    kv = (k.contiguous(), v.contiguous())
    own = hop = None
    steps = ring_steps(layout, kernel, length)
    for step in range(steps):
        pending = ring.start(kv) if step < steps - 1 else None
        visiting = layout.spans((layout.index - step) % layout.size, length)
        dq_step, dk, dv = _held_block_grads(kernel, parts, visiting, kv)
        # release the block just used (and its views) before anything else is allocated
        kv = None
        dq = [d if s is None else _added(d, s, acc_dtype) for d, s in zip(dq, dq_step)]
        dq_step = None
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
            home = 1 if step < steps - 1 else 1 - steps   # the last send: to the block's own rank
            hop = ring.start((dk.to(k.dtype), dv.to(v.dtype)), home)
        dk = dv = None
        if pending is not None:
            kv = tuple(pending.wait())
            pending = None
    dk, dv = own
    own = None
    if hop is not None:
        arrived, hop = hop.wait(), None
        dk, dv = dk + arrived[0], dv + arrived[1]
    dq = [d if d is not None else p.new_zeros(p.shape) for d, p in zip(dq, parts[0])]
    return _cat(dq, SEQ, q).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _backward(ctx, grad_out):
    q, k, v, out, lse, *sinks = ctx.saved_tensors
    grads = _per_head_group(q, k, (q, k, v, out, lse, grad_out),
                            lambda *t: _ring_backward(ctx.layout, ctx.kernel, *t))
    dsinks = sinks_grad(grad_out, out, lse, sinks[0]) if sinks else None
    return tuple(grads) + (dsinks, None, None)


_RING_ATTENTION = lazy_autograd_function("RingAttention", _forward, _backward)


def run_ring(q: Any, k: Any, v: Any, layout: Any, kernel: Any, sinks: Any = None) -> Any:
    """Differentiable ring attention of this rank's (batch, heads, seq, dim) blocks with ``kernel``
    on each (query chunk, key chunk) pair; ``sinks``: one logit per query head held here, or None."""
    if q.shape[HEADS] % k.shape[HEADS]:
        raise ValueError(f"ring attention: {q.shape[HEADS]} query heads are not a multiple of "
                         f"{k.shape[HEADS]} key/value heads")
    return _RING_ATTENTION(q, k, v, sinks, layout, _shared_kv(kernel, q, k))


def ring_attention(q: Any, k: Any, v: Any, layout: Any, causal: bool = False, scale: Any = None,
                   softcap: Any = None, window: Any = None, sinks: Any = None) -> Any:
    """Attention of local queries against the K/V blocks of every rank in ``layout``'s ring.

    q, k, v: this rank's (batch, heads, seq, dim) blocks (k/v may have fewer heads: GQA). softcap,
    window, sinks: as ``hyper_parallel.attention``'s (the sinks of this rank's query heads)."""
    return run_ring(q, k, v, layout, CausalBlocks(causal, scale, softcap, window), sinks)
