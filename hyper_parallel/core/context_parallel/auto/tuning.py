"""Close calls are timed, not guessed: the candidates whose predicted times lie within ``MARGIN`` of
the best run once on this call's own shapes, and the fastest runs from then on.

The cost model's fixed terms (per-call overheads, latencies) are calibrated on tiny inputs and, on
a machine whose ranks share cores or a link, vary from one calibration to the next by as much as
the difference between two modes of a small call. Timing the shortlist on the real q/k/v settles
such calls the way cuDNN's benchmark mode settles convolution algorithms. The timed module is a
stand-in (scaled dot-product attention in the caller's layout, causal as the style's hint), never
the user's, so a module with state (a KV cache, a counter, dropout's random stream) runs exactly as
often as the user calls it. Each candidate runs forward and backward (on detached copies of q, k,
v: the user's graph is untouched), round-robin with the others, the median of five; every rank
takes the slowest rank's times (one all-reduce), so every rank picks alike. The result is cached
per mesh and signature, so the layers of a model that share a shape tune once.
"""
import contextlib
import statistics
import time
from typing import Any, Iterator

from hyper_parallel.core.bounded_cache import BoundedCache
from hyper_parallel.core.context_parallel.masks import attention_masks
from hyper_parallel.core.context_parallel.mode import run_attention
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform

MARGIN = 1.5       # a candidate predicted within this factor of the best is timed
SHORTLIST = 3      # at most this many, fastest predicted first
ROUNDS = 5         # timed rounds (each runs every candidate once)
_TIMED = BoundedCache(256)


@contextlib.contextmanager
def outside_user_state() -> Iterator[None]:
    """The stand-ins and the calibration run here, never in the caller's state: not under its
    ``attention_masks`` (they describe the caller's sequence, not a stand-in's), nor its grad mode,
    inference mode or autocast (the framework's default computation state)."""
    with attention_masks(), get_platform().default_compute_state():
        yield


def shortlist(predicted: Any) -> Any:
    """The candidate names worth timing, best predicted first (one name: nothing to time)."""
    ranked = sorted(predicted, key=lambda name: (predicted[name], name))
    best = predicted[ranked[0]]
    return [name for name in ranked[:SHORTLIST] if predicted[name] <= MARGIN * best]


def timed_seconds(key: Any, mesh: Any, qkv: Any, dims: Any, causal: Any, runners: Any) -> Any:
    """{name: measured seconds of a forward + backward} of each ``runners`` entry (name -> (fixed-mode
    style, its mesh)), the slowest rank's; cached under ``key``."""
    found = _TIMED.get(key)
    if found is None:
        platform = get_platform()
        call = stand_in(dims, causal, qkv)
        steps = [_step(platform, style, sub_mesh, qkv, call) for style, sub_mesh in runners.values()]
        with outside_user_state():
            seconds = _interleaved(platform, steps)
        slowest = platform.all_reduce(platform.tensor(seconds, dtype=platform.float32()), mesh.get_group(0),
                                      "max", tag="cp-auto-tuning")
        found = _TIMED[key] = dict(zip(runners, (float(s) for s in slowest.tolist())))
    return found


def _step(platform, style, mesh, qkv, call):
    run = lambda *t: _local(run_attention(style, mesh, list(t), call))  # noqa: E731
    return lambda: platform.forward_backward(run, qkv)


def _interleaved(platform, steps):
    """Median seconds of each step, timed round-robin (every round runs each once, so a change of
    load on a shared machine hits them alike), after one warm-up round."""
    samples = [[] for _ in steps]
    for round_ in range(ROUNDS + 1):
        for step, taken in zip(steps, samples):
            platform.synchronize()
            start = time.perf_counter()
            step()
            platform.synchronize()
            if round_:
                taken.append(time.perf_counter() - start)
    return [statistics.median(taken) for taken in samples]


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def stand_in(dims: Any, causal: Any, qkv: Any) -> Any:
    """call(q, k, v): scaled dot-product attention on q/k/v laid out as the caller's (``dims`` =
    (seq, head); the last dim is the head dim, the others batch), its output in the same layout."""
    seq, head = dims
    ndim = len(qkv[0].shape)
    order = [d for d in range(ndim) if d not in (seq, head, ndim - 1)] + [head, seq, ndim - 1]
    back = [order.index(d) for d in range(ndim)]
    gqa = qkv[0].shape[head] != qkv[1].shape[head]

    def call(q, k, v):
        q, k, v = (t.permute(*order) for t in (q, k, v))
        # returned in q's layout, as attention modules do (a (B, H, S, D) output whose S equals D
        # would leave the output's sequence dim ambiguous)
        return get_platform().sdpa(q, k, v, is_causal=causal, enable_gqa=gqa).permute(*back)
    return call
