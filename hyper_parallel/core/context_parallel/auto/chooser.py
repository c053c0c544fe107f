"""``mode="auto"``: per shape signature, rank the candidates by predicted time and run the best.

The choice is made once per signature (q/k/v local shapes and dtype, masks on or off, the mesh)
and cached. Where several candidates are predicted close to the best, they are timed on the call's
own shapes and the fastest wins (tuning.py; ``tune=False`` keeps the prediction's choice; calls
under ``attention_masks`` keep it too, since the stand-in that is timed takes no masks, and so do
calls without gradients, which have no backward to time). Before the
first choice of a signature the ranks compare their shapes (the same one-message check every mode
runs first), so a rank that disagrees raises on every rank instead of choosing another mode and
waiting in another collective. ``style.last_choice`` says what was chosen
and every candidate's predicted time; the first choice of each signature is also logged.
"""
from typing import Any
import logging
import os
import zlib
from dataclasses import dataclass, field

from hyper_parallel.core.agreement import Deferred, check_agreement
from hyper_parallel.core.bounded_cache import BoundedCache, lifetime_key
from hyper_parallel.core.context_parallel.auto.calibration import ENV as CALIBRATION_ENV, machine_for
from hyper_parallel.core.context_parallel.auto.cost_model import CallShape, candidates, predict
from hyper_parallel.core.context_parallel.auto.tuning import shortlist, timed_seconds
from hyper_parallel.core.context_parallel.checks import check_across_ranks, normalise_dims
from hyper_parallel.core.context_parallel.masks import active_masks
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.platform import get_platform

LOG = logging.getLogger("hyper_parallel.context_parallel")


@dataclass
class Choice:
    """What ``mode="auto"`` chose for one signature, and why."""
    mode: str
    kwargs: dict
    predicted_seconds: dict = field(default_factory=dict)   # every candidate that can run
    measured_seconds: dict = field(default_factory=dict)    # the close ones, timed on this call's shapes
    held_bytes: dict = field(default_factory=dict)
    over_budget: list = field(default_factory=list)         # candidates refused by memory_budget

    def __str__(self):
        times = ", ".join(f"{n} {s * 1e3:.3g} ms"
                          for n, s in sorted(self.predicted_seconds.items(), key=lambda kv: kv[1]))
        over = f"; over memory_budget: {', '.join(self.over_budget)}" if self.over_budget else ""
        timed = ", ".join(f"{n} {s * 1e3:.3g} ms"
                          for n, s in sorted(self.measured_seconds.items(), key=lambda kv: kv[1]))
        timed = f"; timed fwd+bwd: {timed}" if timed else ""
        return f"chose {self.mode} ({self.kwargs}); predicted fwd+bwd: {times}{timed}{over}"


def _itemsize(dtype):
    return get_platform().dtype_itemsize(dtype)   # from the framework: float8's name ends in digits too


def _file_digest(path):
    """The calibration file's contents as a number (None: measured); read only when the ranks compare."""
    if not path:
        return None
    with open(path, "rb") as f:
        return zlib.crc32(f.read())


def call_shape(style: Any, qkv: Any, cp: Any, causal: Any) -> Any:
    raw = [t.to_local() if isinstance(t, DTensor) else t for t in qkv]
    seq, head = normalise_dims(style, [t.ndim for t in raw])
    q, k, v = raw
    batch = 1
    for d, size in enumerate(q.shape):
        if d not in (seq, head, q.ndim - 1):
            batch *= int(size)
    return CallShape(batch=batch, q_len=int(q.shape[seq]) * cp,
                     kv_len=int(k.shape[seq]) * cp, q_heads=int(q.shape[head]), kv_heads=int(k.shape[head]),
                     head_dim=int(q.shape[-1]), v_head_dim=int(v.shape[-1]), itemsize=_itemsize(q.dtype),
                     causal=causal)


class AutoMode:
    """One ContextParallel(mode="auto") style's choices and the sub-styles that run them."""

    def __init__(self, style: Any) -> None:
        self.style = style
        self._chosen = BoundedCache(256)    # signature -> (Choice, sub-style, its mesh)
        self._styles: dict[Any, Any] = {}                   # candidate -> (sub-style, its mesh)

    def resolve(self, mesh: Any, qkv: Any) -> Any:
        """(sub-style, its mesh) for this call, choosing on a new signature."""
        raw = [t.to_local() if isinstance(t, DTensor) else t for t in qkv]
        key = (mesh.to_hash(), active_masks() is not None,
               tuple((tuple(t.shape), str(t.dtype)) for t in raw))
        found = self._chosen.get(key)
        if found is None:
            self._agree(mesh, key)
            check_across_ranks(mesh, raw)   # the ranks agree on what they choose from
            found = self._chosen[key] = self._choose(mesh, qkv, key)
            LOG.info("ContextParallel(mode='auto') on %d ranks: %s", mesh.size(), found[0])
        self.style.last_choice = found[0]
        return found[1], found[2]

    def _agree(self, mesh, key):
        """Every input of the choice but the shapes (checked next) is the same on every rank: else
        the ranks would choose different modes (or one would time candidates alone) and wait in
        different collectives."""
        style, path = self.style, self.style.calibration or os.environ.get(CALIBRATION_ENV)
        settings = {"causal hint": style.causal, "memory_budget": style.memory_budget, "tune": style.tune,
                    "grad mode (is_grad_enabled)": bool(get_platform().is_grad_enabled()),
                    "attention_masks entered": key[1], "calibration": "file" if path else "measured",
                    "calibration file contents": Deferred(lambda: _file_digest(path))}
        check_agreement(mesh, "ContextParallel(mode='auto')", settings, signature=lifetime_key(style),
                        fix="give mode='auto' the same options, calibration file and grad mode on every rank")

    def _choose(self, mesh, qkv, key):
        style = self.style
        shape = call_shape(style, qkv, mesh.size(), style.causal)
        machine = machine_for(mesh, style.calibration, style.fixed)
        predicted, held, over = {}, {}, []
        options = {}
        for candidate in candidates(shape, mesh.size()):
            seconds, nbytes = predict(shape, mesh.size(), candidate, machine)
            held[candidate.name] = nbytes
            if style.memory_budget is not None and nbytes > style.memory_budget:
                over.append(candidate.name)
                continue
            predicted[candidate.name], options[candidate.name] = seconds, candidate
        if not options:
            smallest = min(held.items(), key=lambda kv: kv[1]) if held else ("none", 0)
            raise ValueError(f"ContextParallel(mode='auto'): no mode fits "
                             f"memory_budget={style.memory_budget} bytes for {shape} on {mesh.size()} ranks "
                             f"(the smallest, {smallest[0]}, holds {smallest[1]:.0f} bytes of k/v); raise "
                             f"the budget or use more ranks")
        best, measured = min(options, key=lambda name: (predicted[name], name)), {}
        # timed forward + backward: in training only (under no_grad / inference the call has no
        # backward to time, and an inference-mode tensor cannot take one)
        tunable = style.tune and active_masks() is None and get_platform().is_grad_enabled()
        close = shortlist(predicted) if tunable else []
        if len(close) > 1:
            runners = {name: self._sub_style(options[name], mesh) for name in close}
            dims = normalise_dims(style, [len(t.shape) for t in qkv])
            measured = timed_seconds(key + (style.causal, dims, tuple(close)), mesh, qkv, dims, style.causal,
                                     runners)
            best = min(measured, key=lambda name: (measured[name], name))
        choice = Choice(best, options[best].kwargs(), predicted, measured, held, over)
        sub_style, sub_mesh = self._sub_style(options[best], mesh)
        return choice, sub_style, sub_mesh

    def _sub_style(self, candidate, mesh):
        if candidate not in self._styles:
            sub = self.style.fixed(**candidate.kwargs())
            self._styles[candidate] = (sub, sub._cp_mesh(mesh))
        return self._styles[candidate]
