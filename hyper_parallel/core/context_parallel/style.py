"""ContextParallel: a ParallelStyle for core-attention modules (contract: docs/context_parallel.md).

Each rank passes its contiguous block of the sequence. Depending on ``ulysses_degree`` (ds) the
style runs Ulysses (all-to-all sequence → heads), all-gather KV (queries stay split, K/V gathered,
the attention rule applies the global causal offset), or the hybrid of both on a (co, ds) mesh.
The module's forward sees DTensors, so plain matmul/softmax attention code is distributed by the
same sharding rules as ``F.scaled_dot_product_attention``.
"""
from typing import Any, Literal, Optional, Sequence, Union
import contextvars
import os

from hyper_parallel.core.arguments import check_context_parallel
from hyper_parallel.core.agreement import check_agreement
from hyper_parallel.core.context_parallel.auto.chooser import AutoMode
from hyper_parallel.core.context_parallel.checks import style_settings
from hyper_parallel.core.context_parallel.supported_kernels import call_module
from hyper_parallel.core.context_parallel.mode import run_attention
from hyper_parallel.core.context_parallel.overlap.split_call import PendingAttention, start_call
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.tensor_parallel.style import ParallelStyle
from hyper_parallel.core.typing import Module
from hyper_parallel.platform import get_platform

KV_EXCHANGES = ("allgather", "ring")
_active: Any = contextvars.ContextVar("hp_context_parallel_active", default=frozenset())
# a module's split-phase call (start_attention) lives on the module: a global table would keep it, and
# through its closure the module and its weights, alive after the model is gone
_STARTER = "_hp_cp_start"
_APPLY_FIX = "construct ContextParallel with the same arguments on every rank of the mesh"


def start_attention(module: Module, *args: Any, **kwargs: Any) -> PendingAttention:
    """Start ``module(*args, **kwargs)`` on a module ContextParallel was applied to, returning a
    pending call whose ``finish()`` gives the output ``module(...)`` would: q/k/v's collective
    travels in between, so the caller can compute meanwhile (e.g. the next head group's
    projections; contract and limits: split_call.py, docs/context_parallel.md). Like any
    collective, calls must be started, and finished, in the same order on every rank, and every
    started call finished."""
    starter = getattr(module, _STARTER, None)
    if starter is None:
        raise ValueError(f"start_attention: {type(module).__name__} has no ContextParallel applied; "
                         f"apply ContextParallel / AsyncContextParallel to it first")
    return starter(*args, **kwargs)


class ContextParallel(ParallelStyle):
    def __init__(self, seq_dim: int = 1, head_dim: int = 2, ulysses_degree: Optional[int] = None,
                 qkv_indices: Sequence[int] = (0, 1, 2), qkv_kwarg_names: Sequence[str] = (),
                 use_local_output: bool = False, load_balance: bool = False,
                 kv_exchange: Literal["allgather", "ring"] = "allgather", overlap: bool = False,
                 chunks: int = 2, mode: Optional[Literal["auto"]] = None,
                 memory_budget: Optional[float] = None,
                 calibration: Union[str, "os.PathLike[str]", None] = None, causal: Optional[bool] = None,
                 tune: Optional[bool] = None) -> None:
        check_context_parallel(seq_dim, head_dim, ulysses_degree, chunks, memory_budget, qkv_indices)
        _check_auto(mode, ulysses_degree, load_balance, kv_exchange, memory_budget, calibration, causal, tune)
        if seq_dim == head_dim:
            raise ValueError(f"seq_dim and head_dim must differ (got {seq_dim}); use 1/2 for BSHD, "
                             "2/1 for BNSD")
        if ulysses_degree is not None and (not isinstance(ulysses_degree, int) or ulysses_degree < 1):
            raise ValueError(f"ulysses_degree must be a positive int or None, got {ulysses_degree!r}")
        if load_balance and ulysses_degree != 1:
            raise ValueError(f"load_balance=True needs ulysses_degree=1 (all-gather KV), got "
                             f"ulysses_degree={ulysses_degree!r}; set ulysses_degree=1 or load_balance=False")
        if kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange={kv_exchange!r} is not one of {KV_EXCHANGES}")
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"chunks={chunks!r} must be a positive int (the head groups overlap=True "
                             f"pipelines; 1 turns the pipelining off)")
        if len(qkv_indices) != 3 and len(qkv_kwarg_names) < 3:
            raise ValueError(f"qkv_indices {qkv_indices} must name three positions (q, k, v)")
        self.seq_dim, self.head_dim = seq_dim, head_dim
        self.ulysses_degree = ulysses_degree
        self.qkv_indices, self.qkv_kwarg_names = tuple(qkv_indices), tuple(qkv_kwarg_names)
        self.use_local_output = use_local_output
        self.load_balance = load_balance
        self.kv_exchange = kv_exchange
        self.overlap, self.chunks = bool(overlap), chunks
        # mode="auto": the mode is chosen per shape signature (auto/); causal is the cost model's hint
        self.mode, self.memory_budget, self.calibration = mode, memory_budget, calibration
        self.causal = True if causal is None else bool(causal)
        self.tune = True if tune is None else bool(tune)   # time close calls on the call's shapes
        self.last_choice = None
        self._auto = AutoMode(self) if mode == "auto" else None

    def fixed(self, **mode_kwargs: Any) -> "ContextParallel":
        """This style with a fixed mode (``ulysses_degree`` / ``kv_exchange`` / ``load_balance``)."""
        return ContextParallel(self.seq_dim, self.head_dim, qkv_indices=self.qkv_indices,
                               qkv_kwarg_names=self.qkv_kwarg_names, use_local_output=self.use_local_output,
                               overlap=self.overlap, chunks=self.chunks, **mode_kwargs)

    # ------------------------------------------------------------------ apply
    def apply(self, module: Module, device_mesh: DeviceMesh) -> Module:
        # before _cp_mesh creates the hybrid's groups: a rank with another ulysses_degree would
        # otherwise create groups its peers never create, and wait there
        check_agreement(device_mesh, "ContextParallel", style_settings(self), fix=_APPLY_FIX,
                        once=False)
        mesh = self._cp_mesh(device_mesh)
        get_platform().replace_forward(module, lambda original: self._make_forward(module, original, mesh))
        return module

    def _cp_mesh(self, mesh):
        """The CP mesh: 1-D for pure Ulysses / all-gather, a 2-D mesh named ("co", "ds") in either
        order for the hybrid (used by name: rank (co=c, ds=d) holds sequence block c·ds + d)."""
        if self.mode == "auto" and mesh.ndim != 1:
            raise ValueError("ContextParallel(mode='auto') chooses the hybrid's layout itself and needs a "
                             f"1-D CP mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}; pass mesh['cp'] "
                             "(or flatten)")
        if mesh.ndim == 2:
            names = mesh.mesh_dim_names
            if names is None or sorted(names) != ["co", "ds"]:
                raise ValueError(f"a 2-D context-parallel mesh must be named ('co', 'ds') (either order), "
                                 f"got {names}; or pass a 1-D mesh and ulysses_degree")
            if self.ulysses_degree not in (None, mesh.size("ds")):
                raise ValueError(f"ulysses_degree={self.ulysses_degree} does not match the mesh's ds size "
                                 f"{mesh.size('ds')}")
            # ds of size 1: rank (co=c, ds=0) holds block c, so the co dim alone is the 1-D CP mesh
            # (load balancing and the pure ring run on one dim)
            return mesh["co"] if mesh.size("ds") == 1 else mesh
        if mesh.ndim != 1:
            raise ValueError("ContextParallel needs a 1-D CP mesh or a 2-D ('co', 'ds') mesh, got "
                             f"{mesh.ndim}-D {mesh.mesh_dim_names}; slice it, e.g. mesh['cp']")
        cp = mesh.size()
        ds = self.ulysses_degree or cp
        if cp % ds:
            raise ValueError(f"ulysses_degree={ds} does not divide the context-parallel size {cp}")
        if self.kv_exchange == "ring" and ds == cp and cp > 1:
            raise ValueError(f"kv_exchange='ring' rings K/V over cp/ulysses_degree ranks, but ulysses_degree="
                             f"{self.ulysses_degree} leaves none (cp={cp}); set ulysses_degree=1 for pure "
                             f"ring or 1 < ulysses_degree < {cp} for Ulysses x ring")
        if 1 < ds < cp:
            return mesh._unflatten(0, (cp // ds, ds), ("co", "ds"))
        return mesh

    # ------------------------------------------------------------------ forward
    def _make_forward(self, module, original, mesh):
        key = id(module)

        def guarded(run):
            active = _active.get()
            token = _active.set(active | {key})
            try:
                return run()
            finally:
                _active.reset(token)

        def forward(*args, **kwargs):
            if key in _active.get():  # a recursive call: inputs are already distributed
                return original(*args, **kwargs)
            qkv, call = self._bind(original, args, kwargs)
            return guarded(lambda: run_attention(*self._resolve(mesh, qkv), qkv, call))

        def start(*args, **kwargs):
            qkv, call = self._bind(original, args, kwargs)
            style, cp_mesh = self._resolve(mesh, qkv)
            # finish() runs the module later: inside the guard again, as forward does
            return guarded(lambda: start_call(style, cp_mesh, qkv, lambda *t: guarded(lambda: call(*t))))
        object.__setattr__(module, _STARTER, start)
        return forward

    def _resolve(self, mesh, qkv):
        """(the style that runs this call, its CP mesh): this one, or mode="auto"'s choice."""
        return (self, mesh) if self._auto is None else self._auto.resolve(mesh, qkv)

    def _locate_qkv(self, args, kwargs):
        slots = []
        for i, index in enumerate(self.qkv_indices):
            if index < len(args):
                slots.append(("arg", index))
            elif i < len(self.qkv_kwarg_names) and self.qkv_kwarg_names[i] in kwargs:
                slots.append(("kw", self.qkv_kwarg_names[i]))
            else:
                name = ("q", "k", "v")[i]
                raise ValueError(f"ContextParallel: {name} is missing from the call (looked at position "
                                 f"{index} and keyword {self.qkv_kwarg_names[i:i + 1] or '-'}); set "
                                 f"qkv_indices / qkv_kwarg_names to where the module takes q, k, v")
        return slots

    def _bind(self, original, args, kwargs):
        """(q, k, v of this call, call(q, k, v) running the module's own forward with them in place)."""
        slots = self._locate_qkv(args, kwargs)
        get = lambda s: args[s[1]] if s[0] == "arg" else kwargs[s[1]]  # noqa: E731

        def call(q, k, v):
            new_args, new_kwargs = list(args), dict(kwargs)
            for slot, value in zip(slots, (q, k, v)):
                if slot[0] == "arg":
                    new_args[slot[1]] = value
                else:
                    new_kwargs[slot[1]] = value
            return call_module(original, new_args, new_kwargs)   # flex_attention -> clear error
        return [get(s) for s in slots], call


def _check_auto(mode, ulysses_degree, load_balance, kv_exchange, memory_budget, calibration, causal, tune):
    if mode not in (None, "auto"):
        raise ValueError(f"mode={mode!r} is not supported: pass mode='auto' (chosen per shape), or leave it "
                         f"unset and choose with ulysses_degree / kv_exchange / load_balance")
    if mode == "auto":
        fixed = {k: v for k, v in (("ulysses_degree", ulysses_degree), ("load_balance", load_balance or None),
                                   ("kv_exchange", None if kv_exchange == "allgather" else kv_exchange)) if v}
        if fixed:
            raise ValueError(f"mode='auto' chooses ulysses_degree, kv_exchange and load_balance itself; "
                             f"drop {sorted(fixed)} or drop mode='auto'")
        if memory_budget is not None and (not isinstance(memory_budget, (int, float)) or memory_budget <= 0):
            raise ValueError(f"memory_budget={memory_budget!r} must be a positive number of bytes")
        return
    given = [n for n, v in (("memory_budget", memory_budget), ("calibration", calibration),
                            ("causal", causal), ("tune", tune)) if v is not None]
    if given:
        raise ValueError(f"{given} only apply to mode='auto'; pass mode='auto' or drop them")


class AsyncContextParallel(ContextParallel):
    """``ContextParallel`` with ``overlap=True``: each call is pipelined over ``chunks`` head groups,
    so one group's q/k/v and output collectives travel while another computes, in forward and
    backward (overlap.py; modes it cannot pipeline run as ContextParallel does)."""

    def __init__(self, *args: Any, overlap: bool = True, **kwargs: Any) -> None:
        # overlap is keyword-only here, so it cannot also come in *args
        super().__init__(*args, overlap=overlap, **kwargs)  # type: ignore[misc]
