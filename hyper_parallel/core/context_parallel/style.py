"""ContextParallel: a ParallelStyle for core-attention modules (contract: docs/context_parallel.md).

Each rank passes its contiguous block of the sequence. Depending on ``ulysses_degree`` (ds) the
style runs Ulysses (all-to-all sequence → heads), all-gather KV (queries stay split, K/V gathered,
the attention rule applies the global causal offset), or the hybrid of both on a (co, ds) mesh.
The module's forward sees DTensors, so plain matmul/softmax attention code is distributed by the
same sharding rules as ``F.scaled_dot_product_attention``.
"""
from typing import Any, Callable, Literal, Optional, Sequence, Tuple, Union
from dataclasses import replace
import contextvars
import os

from hyper_parallel.core.agreement import check_agreement
from hyper_parallel.core.context_parallel.auto.chooser import AutoMode, Choice
from hyper_parallel.core.context_parallel.config import (CPAuto, CPExchange, CPLayout, CPOverlap,
                                                         ContextParallelConfig, check_auto_exchange)
from hyper_parallel.core.context_parallel.checks import style_settings
from hyper_parallel.core.context_parallel.supported_kernels import call_module
from hyper_parallel.core.context_parallel.mode import run_attention
from hyper_parallel.core.context_parallel.overlap.split_call import PendingAttention, start_call
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.tensor_parallel.style import ParallelStyle
from hyper_parallel.core.typing import Module
from hyper_parallel.platform import get_platform

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


def _setting(group: str, name: str) -> Any:
    """A read-only attribute of the style reading ``style.config.<group>.<name>``: readers keep the
    flat names the constructor takes (``style.seq_dim``, ``style.ulysses_degree``, ...)."""
    return property(lambda self: getattr(getattr(self.config, group), name),
                    doc=f"``config.{group}.{name}`` (read-only: build another style to change it)")


class ContextParallel(ParallelStyle):
    """Context parallelism for a core-attention module. The flat keywords are kept in ``self.config``
    (a ``ContextParallelConfig``: layout / exchange / overlap / auto); ``style.seq_dim`` etc. read it."""

    def __init__(self, seq_dim: int = 1, head_dim: int = 2, ulysses_degree: Optional[int] = None,
                 qkv_indices: Sequence[int] = (0, 1, 2), qkv_kwarg_names: Sequence[str] = (),
                 use_local_output: bool = False, load_balance: bool = False,
                 kv_exchange: Literal["allgather", "ring"] = "allgather", overlap: bool = False,
                 chunks: int = 2, mode: Optional[Literal["auto"]] = None,
                 memory_budget: Optional[float] = None,
                 calibration: Union[str, "os.PathLike[str]", None] = None, causal: Optional[bool] = None,
                 tune: Optional[bool] = None) -> None:
        # each group checks its own fields as it is built, the config the checks across groups; auto
        # first, so mode='auto' with a fixed exchange reports that conflict (as before the groups)
        auto = CPAuto(mode, memory_budget, calibration, causal, tune)
        check_auto_exchange(auto, ulysses_degree, load_balance, kv_exchange)
        config = ContextParallelConfig(
            layout=CPLayout(seq_dim, head_dim, tuple(qkv_indices), tuple(qkv_kwarg_names), use_local_output),
            exchange=CPExchange(ulysses_degree, load_balance, kv_exchange),
            overlap=CPOverlap(overlap, chunks), auto=auto)
        self._configure(config)

    @classmethod
    def from_config(cls, config: ContextParallelConfig) -> "ContextParallel":
        """The style of a (checked) ``ContextParallelConfig``."""
        style = cls.__new__(cls)
        style._configure(config)
        return style

    def _configure(self, config: ContextParallelConfig) -> None:
        self.config = config
        self.last_choice: Optional[Choice] = None
        # mode="auto": the mode is chosen per shape signature (auto/)
        self._auto = AutoMode(self) if config.auto.mode == "auto" else None

    seq_dim = _setting("layout", "seq_dim")
    head_dim = _setting("layout", "head_dim")
    qkv_indices = _setting("layout", "qkv_indices")
    qkv_kwarg_names = _setting("layout", "qkv_kwarg_names")
    use_local_output = _setting("layout", "use_local_output")
    ulysses_degree = _setting("exchange", "ulysses_degree")
    load_balance = _setting("exchange", "load_balance")
    kv_exchange = _setting("exchange", "kv_exchange")
    overlap = _setting("overlap", "overlap")
    chunks = _setting("overlap", "chunks")
    mode = _setting("auto", "mode")
    memory_budget = _setting("auto", "memory_budget")
    calibration = _setting("auto", "calibration")
    causal = _setting("auto", "causal_hint")     # the cost model's hint: True unless causal=False
    tune = _setting("auto", "tuned")             # time close calls on the call's shapes

    def fixed(self, **mode_kwargs: Any) -> "ContextParallel":
        """This style with a fixed mode (``ulysses_degree`` / ``kv_exchange`` / ``load_balance``)."""
        return ContextParallel.from_config(replace(self.config, exchange=CPExchange(**mode_kwargs),
                                                   auto=CPAuto()))

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

        def guarded(run: Callable[[], Any]) -> Any:
            active = _active.get()
            token = _active.set(active | {key})
            try:
                return run()
            finally:
                _active.reset(token)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if key in _active.get():  # a recursive call: inputs are already distributed
                return original(*args, **kwargs)
            qkv, call = self._bind(original, args, kwargs)
            return guarded(lambda: run_attention(*self._resolve(mesh, qkv), qkv, call))

        def start(*args: Any, **kwargs: Any) -> Any:
            qkv, call = self._bind(original, args, kwargs)
            style, cp_mesh = self._resolve(mesh, qkv)
            # finish() runs the module later: inside the guard again, as forward does
            return guarded(lambda: start_call(style, cp_mesh, qkv, lambda *t: guarded(lambda: call(*t))))
        object.__setattr__(module, _STARTER, start)
        return forward

    def _resolve(self, mesh: Any, qkv: Any) -> Tuple[Any, Any]:
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

        def call(q: Any, k: Any, v: Any) -> Any:
            new_args, new_kwargs = list(args), dict(kwargs)
            for slot, value in zip(slots, (q, k, v)):
                if slot[0] == "arg":
                    new_args[slot[1]] = value
                else:
                    new_kwargs[slot[1]] = value
            return call_module(original, new_args, new_kwargs)   # flex_attention -> clear error
        return [get(s) for s in slots], call


class AsyncContextParallel(ContextParallel):
    """``ContextParallel`` with ``overlap=True``: each call is pipelined over ``chunks`` head groups,
    so one group's q/k/v and output collectives travel while another computes, in forward and
    backward (overlap.py; modes it cannot pipeline run as ContextParallel does)."""

    def __init__(self, *args: Any, overlap: bool = True, **kwargs: Any) -> None:
        # overlap is keyword-only here, so it cannot also come in *args
        super().__init__(*args, overlap=overlap, **kwargs)  # type: ignore[misc]
