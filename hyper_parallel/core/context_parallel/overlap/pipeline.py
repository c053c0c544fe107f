"""Communication / compute overlap of one context-parallel call (``ContextParallel(overlap=True)``,
``AsyncContextParallel``) by head-chunk pipelining.

The style wraps the core attention: q, k and v exist only when it is called, so their collectives
cannot start under the projections. Heads are independent in Ulysses, all-gather KV and their
hybrid, so the call is cut into ``style.chunks`` head groups (q heads [c·H/n, (c+1)·H/n) with their
k/v heads: the GQA grouping is kept, and k/v heads are those after the replication of
mode._validate). Each chunk's heads must still divide by the Ulysses degree; otherwise the call
runs whole (mode.py's unsplit path). The schedule, forward:

    start in(0); [start in(1)]                     the pipeline fills (one collective per stage)
    chunk c: finish in(c) | advance in(c+1..)     | attention(c) | start out(c)
    finish out(0..n-1), concatenate on the output's head dim

so chunk c+1's q/k/v collective (hybrid: its all-to-all, then its k/v all-gather one slot later)
travels while chunk c computes, and chunk c's output all-to-all while chunk c+1 computes.
Backward mirrors it: the collectives are the platform's split collectives, whose gradient
collective starts at the wait's backward and finishes at the start's; the autograd engine runs
ready nodes newest first, so chunk c's input-gradient collective travels during chunk c-1's
attention backward, and each output-gradient collective during the attention backward of the chunk
after it (see platform/split_collectives.py).

Not pipelined (run whole, exactly as without overlap): load balancing, the ring (which overlaps its
own hops), active attention_masks, a q DTensor on another mesh ("other_mesh"), k/v heads the chunks
cannot split, and layouts the split moves do not cover (uneven blocks, several steps).
"""
from typing import Any, Iterator, List, Set
import contextlib
from dataclasses import replace

from hyper_parallel.core.bounded_cache import BoundedCache, lifetime_key
from hyper_parallel.core.context_parallel.movement.mode_moves import mode_placements
from hyper_parallel.core.context_parallel.output import output_seq_dim
from hyper_parallel.core.context_parallel.movement import Block, KVAllGather, QKVAllToAll, start_output
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform

_observers: list[Any] = []


@contextlib.contextmanager
def observe_pipeline(fn: Any) -> Iterator[None]:
    """Within the block, ``fn(stage, chunk, event)`` hears every collective of the pipeline: stage
    "in" (q/k/v moves) or "out"; event "start" / "wait" / "grad_start" / "grad_wait"."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


def pipeline_observer(stage: Any, chunk: Any) -> Any:
    """``fn(event)`` telling every ``observe_pipeline`` listener about (stage, chunk), or None."""
    if not _observers:
        return None
    listeners = list(_observers)
    return lambda event: [fn(stage, chunk, event) for fn in listeners]


def pipelinable(style: Any, inputs: Any, masks: Any) -> Any:
    """Whether this call may be pipelined at all (the other modes run whole)."""
    return (style.overlap and style.chunks > 1 and masks is None and not style.load_balance
            and style.kv_exchange != "ring" and inputs.policy != "other_mesh")


def chunk_count(style: Any, inputs: Any, ds: Any) -> Any:
    """The number of head chunks (1: not chunkable). Every q, k, v chunk keeps heads divisible by
    the Ulysses degree, and q heads a multiple of k/v heads (GQA groups stay whole)."""
    n = style.chunks
    heads = [t.shape[inputs.head] for t in inputs.locals]
    if heads[1] != heads[2] or heads[1] == 0 or heads[0] % heads[1]:
        return 1
    return n if all(h % (n * ds) == 0 for h in heads) else 1


def _chunks(inputs, n):
    """The ``n`` head chunks: per chunk, the q, k, v blocks of its heads in the input layout (one
    chunk() per tensor: its backward is one concatenation, not a zero-filled buffer per chunk)."""
    parts = [t.chunk(n, inputs.head) for t in inputs.locals]
    shapes = []
    for shape in inputs.shapes:
        shape = list(shape)
        shape[inputs.head] //= n
        shapes.append(tuple(shape))
    return [[Block(pieces[c], tuple(p), shape) for pieces, p, shape in zip(parts, inputs.placements, shapes)]
            for c in range(n)]


_STAGES = BoundedCache(256)    # per chunk signature: the stages (they hold no tensors)
# per (style, call signature): the global shape of the whole call's output (learnt from a call run
# whole), or None where the chunk outputs could not be joined: run whole
_WHOLE_OUTPUT_SHAPES = BoundedCache(256)


def _signature(blocks, inputs, ulysses_dims, gather_dims):
    return (inputs.mesh, inputs.seq, inputs.head, tuple(ulysses_dims), tuple(gather_dims),
            tuple((b.placements, b.shape, tuple(b.local.shape), b.local.dtype) for b in blocks))


def _remember(key, shape):
    _WHOLE_OUTPUT_SHAPES[key] = shape


def recording(style: Any, inputs: Any, ulysses_dims: Any, gather_dims: Any, call: Any) -> Any:
    """``call`` for a pipelinable call run whole: the first time for its signature, it also records
    the global shape of the whole output, from which later calls learn where the chunks join."""
    key = (lifetime_key(style), _signature(_whole_blocks(inputs), inputs, ulysses_dims, gather_dims))
    if key in _WHOLE_OUTPUT_SHAPES:
        return call

    def record(*args):
        out = call(*args)
        value = out[0] if isinstance(out, (tuple, list)) else out
        _remember(key, tuple(value.shape) if isinstance(value, DTensor) else None)
        return out
    return record


def _whole_blocks(inputs):
    return [Block(t, tuple(p), tuple(s)) for t, p, s in zip(inputs.locals, inputs.placements, inputs.shapes)]


def _stages(key, blocks, inputs, ulysses_dims, gather_dims):
    """The split moves taking a chunk to the mode's layout, or None where one cannot be split."""
    if key not in _STAGES:
        _STAGES[key] = _new_stages(blocks, inputs, ulysses_dims, gather_dims)
    return _STAGES[key]


def _new_stages(blocks, inputs, ulysses_dims, gather_dims):
    mesh, seq, head, ndim = inputs.mesh, inputs.seq, inputs.head, len(blocks[0].shape)
    staged = [mode_placements(b.placements, mesh, ndim, seq, head, ulysses_dims, [])[0] for b in blocks]
    stages = []
    if ulysses_dims:
        stages.append(QKVAllToAll.plan(mesh, [b.shape for b in blocks], [b.placements for b in blocks],
                                       staged, [tuple(b.local.shape) for b in blocks],
                                       [b.local.dtype for b in blocks]))
    if gather_dims:
        targets = [mode_placements(b.placements, mesh, ndim, seq, head, ulysses_dims, gather_dims)[1]
                   for b in blocks]
        stages.append(KVAllGather.plan(mesh, [b.shape for b in blocks], staged, targets,
                                       [b.local.dtype for b in blocks]))
    return None if not stages or None in stages else tuple(stages)


class _Chunk:
    """One head chunk's inputs travelling through its stages, one collective at a time."""

    def __init__(self, index, blocks, stages):
        self.index, self.blocks, self.stages = index, blocks, list(stages)
        self.finish = None

    def advance(self):
        """Finish the collective in flight (if any) and start the next one (if any)."""
        if self.finish is not None:
            self.blocks, self.finish = self.finish(), None
        if self.stages:
            self.finish = self.stages.pop(0).start(self.blocks, pipeline_observer("in", self.index))

    def drain(self):
        """Finish the collective in flight, if any, and start no other (the chunk is abandoned)."""
        if self.finish is not None:
            self.finish()
            self.finish = None

    def complete(self, mesh):
        """q, k, v of this chunk as DTensors in the mode's layout."""
        while self.finish is not None or self.stages:
            self.advance()
        return [b.dtensor(mesh) for b in self.blocks]


def start_whole(inputs: Any, ulysses_dims: Any, gather_dims: Any) -> Any:
    """The whole call's q/k/v moves (one chunk of every head) with its first collective started, or
    None where they do not split into start and finish (split_call.py)."""
    blocks = _whole_blocks(inputs)
    stages = _stages(_signature(blocks, inputs, ulysses_dims, gather_dims), blocks, inputs, ulysses_dims,
                     gather_dims)
    if stages is None:
        return None
    pipe = _Chunk(0, blocks, stages)
    pipe.advance()
    return pipe


def _join_dim(out, seq, ulysses_dims, heads, whole):  # heads: (the chunk's, the call's)
    """The dim of a chunk's output that holds its heads (outputs concatenate there): the
    dim the Ulysses mesh dims split (the sharding rules keep a head split only where the heads are
    the outer factor of that dim), else the one dim holding exactly the chunk's heads where the
    whole call's output (global shape ``whole``) holds all of them, every other dim equal; None
    where neither says (a flattened heads × dim output in all-gather KV: its order is unknown)."""
    if ulysses_dims:
        split = out.placements[ulysses_dims[-1]]
        if split.is_shard() and split.dim != seq:
            return split.dim
    if whole is None or len(whole) != out.ndim:
        return None
    differ = [d for d in range(out.ndim) if whole[d] != out.shape[d]]
    if len(differ) != 1 or (out.shape[differ[0]], whole[differ[0]]) != heads:
        return None
    return differ[0]


def _attend(c, qkv, chunk_inputs, ulysses_dims, call, head, join):
    """Chunk ``c``'s attention and the start of its output move: (join dim, finish, seq dim,
    placements, layout), or None where the output cannot be joined on a head dim this way (the
    whole call then decides, or raises as without overlap)."""
    try:
        out = call(*qkv)
        out = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(out, DTensor):
            return None
        if head is None:   # chunk 0: where the chunks join, decided before the output moves
            head = join(out, output_seq_dim(out, chunk_inputs, ulysses_dims))
            if head is None:
                return None
        finish, seq, placements = start_output(out, chunk_inputs, ulysses_dims, pipeline_observer("out", c))
    except ValueError:
        return None
    return head, finish, seq, placements, (tuple(out.shape), tuple(out.placements), seq)


def _give_up(key, pipes, outs):
    """Run this call whole: wait for every collective in flight first, so no rank leaves one behind,
    and the whole call decides (or raises) as without overlap. With the whole output's shape known
    the signature runs whole from now on; else the whole call records it and the next call retries."""
    for pipe in pipes:
        pipe.drain()
    for finish in outs:
        finish()
    if key in _WHOLE_OUTPUT_SHAPES:
        _remember(key, None)
    return None


def run_overlapped(style: Any, inputs: Any, ulysses_dims: Any, gather_dims: Any, call: Any) -> Any:
    """(this rank's output block, its seq dim, its placements), like output.to_caller, computed by
    the head-chunk pipeline; None where the call is not pipelined (the caller then runs it whole,
    through ``recording``)."""
    ds = 1
    for m in ulysses_dims:
        ds *= inputs.mesh.size(m)
    n = chunk_count(style, inputs, ds)
    if n == 1:
        return None
    key = (lifetime_key(style), _signature(_whole_blocks(inputs), inputs, ulysses_dims, gather_dims))
    whole = _WHOLE_OUTPUT_SHAPES.get(key, ())
    if whole is None or (whole == () and not ulysses_dims):   # all-gather KV: learn the join dim first
        return None
    chunks = _chunks(inputs, n)
    stages = _stages(_signature(chunks[0], inputs, ulysses_dims, gather_dims), chunks[0], inputs,
                     ulysses_dims, gather_dims)
    if stages is None:
        return None
    pipes = [_Chunk(c, blocks, stages) for c, blocks in enumerate(chunks)]
    depth = len(stages)
    for pipe in pipes[:depth]:
        pipe.advance()
    chunk_inputs = replace(inputs, shapes=[b.shape for b in chunks[0]])
    heads = (chunk_inputs.shapes[0][inputs.head], inputs.shapes[0][inputs.head])
    join = lambda out, seq: _join_dim(out, seq, ulysses_dims, heads, whole or None)  # noqa: E731
    outs: List[Any] = []
    layouts: Set[Any] = set()
    head = None
    for c, pipe in enumerate(pipes):
        qkv = pipe.complete(inputs.mesh)
        for later in pipes[c + 1:c + 1 + depth]:
            later.advance()
        done = _attend(c, qkv, chunk_inputs, ulysses_dims, call, head, join)
        if done is None:
            return _give_up(key, pipes, outs)
        head, finish, seq, placements, layout = done
        layouts.add(layout)
        outs.append(finish)
    if len(layouts) != 1:   # a module whose output layout depends on the heads it is given
        return _give_up(key, pipes, outs)
    return get_platform().cat([finish() for finish in outs], head), seq, placements
