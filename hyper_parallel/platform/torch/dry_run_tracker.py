"""What one training step of a dry run (hyper_parallel.plan) allocates, computes and moves.

``StepTracker`` is a dispatch mode entered inside ``FakeTensorMode`` (or on real tensors, which is
how the tests check it against a real run): every op's outputs are matched to their storage; a
storage is live from the op that created it until its Python object dies (torch keeps it alive
while any tensor, view or saved tensor uses it). fully_shard frees and refills storages in place
(``resize_``, which no dispatch mode sees), so each storage's size is re-read whenever an op touches
it and, before a new peak is recorded, for every live storage: the peak is exact at op granularity.

At the peak the live storages are remembered (weakly) with the phase that created them and whether a
collective used them; ``breakdown`` names them afterwards: parameters, gradients and optimizer state
(storages of the model's parameters, their ``.grad`` and the optimizer's state), communication
buffers (storages a collective read or wrote), activations (made in forward) and temporaries (the
rest). FLOPs use PyTorch's FlopCounterMode formulas, plus the CPU flash-attention kernels it lacks
(causal attention counted as half the score matrix, as the kernels skip the masked blocks).
"""
from typing import Any
import collections
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers",
              "temporaries")
_aten = torch.ops.aten


def _cpu_attention_flops(args, kwargs, backward):
    q, k = args[1 if backward else 0], args[2 if backward else 1]
    causal = kwargs.get("is_causal", args[6] if backward and len(args) > 6 else
                        (args[4] if not backward and len(args) > 4 else False))
    b, h, sq, d = q.shape
    sk = k.shape[2]
    flops = 4 * b * h * sq * sk * d * (2.5 if backward else 1)
    return int(flops / 2) if causal and sq == sk else int(flops)


_EXTRA_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default:
        lambda args, kwargs: _cpu_attention_flops(args, kwargs, False),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        lambda args, kwargs: _cpu_attention_flops(args, kwargs, True),
}


def _tensors(tree):
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _plain(tensor):
    # wrapper subclasses (DTensor) are counted at the level of their local pieces
    return type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter or \
        type(tensor).__name__ == "FakeTensor"


class StepTracker(TorchDispatchMode):
    """``with tracker: ...``; set ``tracker.phase`` ("forward", "backward", "optimizer") around the
    parts of the step; read ``peak_bytes``, ``breakdown(...)``, ``flops``, ``ops`` afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self._live: dict[Any, Any] = {}        # id(storage) -> [weakref, bytes, phase, used by a collective]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._peak: list[Any] = []        # [(weakref, bytes, phase, comm)] at the peak
        self.flops = 0
        self.ops: Any = collections.Counter()   # (flops, bytes touched) -> count, of ops with a FLOP formula
        self.memory_bound_bytes = 0
        self.op_count = 0      # every computing op (not collectives): each costs a dispatch on the host

    def adopt(self, tensors: Any, phase: str = "setup") -> None:
        """Count storages that exist before the step (parameters, optimizer state)."""
        for t in tensors:
            self._observe(t, phase, False)
        self._maybe_peak()

    def _observe(self, tensor, phase, comm):
        storage = tensor.untyped_storage()
        key = id(storage)
        entry = self._live.get(key)
        if entry is None:
            ref = weakref.ref(storage, lambda _, k=key: self._release(k))
            entry = self._live[key] = [ref, 0, phase, comm]
        nbytes = storage.nbytes()
        self.live_bytes += nbytes - entry[1]
        entry[1] = nbytes
        entry[3] = entry[3] or comm

    def _release(self, key):
        entry = self._live.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]

    def _maybe_peak(self):
        if self.live_bytes <= self.peak_bytes:
            return
        # resizes nobody dispatched (fully_shard's free / refill): re-read every live storage
        # a copy: a storage may die (its weakref callback pops it) while this loop runs (gc)
        for entry in list(self._live.values()):
            storage = entry[0]()
            entry[1] = storage.nbytes() if storage is not None else 0
        total = self.live_bytes = sum(entry[1] for entry in list(self._live.values()))
        if total > self.peak_bytes:
            self.peak_bytes = total
            self._peak = [tuple(entry) for entry in list(self._live.values()) if entry[1]]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        comm = func.namespace in ("c10d", "_c10d_functional")
        for t in inputs + outputs:
            if _plain(t):
                self._observe(t, self.phase, comm)
        self._maybe_peak()
        if not comm:
            self.op_count += 1
            self._count(func, args, kwargs, out, inputs, outputs)
        return out

    def _count(self, func, args, kwargs, out, inputs, outputs):
        if not all(_plain(t) for t in inputs + outputs):
            return
        formula = _EXTRA_FLOPS.get(func)
        if formula is not None:
            flops = formula(args, kwargs)
        elif func.overloadpacket in flop_registry:
            flops = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        else:
            flops = 0
        input_ids = {id(t.untyped_storage()) for t in inputs}
        # bytes an op reads and writes (a view writes nothing: its output shares an input's storage)
        moved = sum(t.numel() * t.element_size() for t in inputs) + sum(
            t.numel() * t.element_size() for t in outputs if id(t.untyped_storage()) not in input_ids)
        if flops:
            self.flops += int(flops)
            self.ops[(int(flops), moved)] += 1
        else:
            self.memory_bound_bytes += moved

    def breakdown(self, params: Any, grads: Any, optimizer_state: Any) -> dict:
        """Bytes per category at the peak (``CATEGORIES``), given the tensors of each kind."""
        def keys(tensors):
            return {id(t.untyped_storage()) for t in tensors}
        named = (("parameters", keys(params)), ("gradients", keys(grads)),
                 ("optimizer_state", keys(optimizer_state)))
        out = dict.fromkeys(CATEGORIES, 0)
        for ref, nbytes, phase, comm in self._peak:
            storage = ref()
            key = id(storage) if storage is not None else None
            category = next((name for name, ks in named if key in ks), None)
            if category is None:
                category = ("communication_buffers" if comm else
                            "activations" if phase == "forward" else "temporaries")
            out[category] += nbytes
        return out
