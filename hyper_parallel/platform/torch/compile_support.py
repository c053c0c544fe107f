"""torch.compile of parallelized modules (docs/compile.md).

Dynamo cannot trace core's DTensor dispatch (per-signature caches, custom autograd nodes, wrapper
construction), but AOTAutograd can *run* it: it executes Python on fake / functional tensors and
records only the tensor ops. So a parallelized module is compiled as one opaque call in dynamo's
graph (``torch._dynamo.allow_in_graph``) whose inputs are plain local tensors:

- outside the compiled region (eager, differentiable), every DTensor parameter and input becomes
  its local shard (``to_local``);
- inside, AOTAutograd traces the module's own forward with those shards wrapped back into
  DTensors of the same layout, so core's sharding rules, redistributions and autograd functions
  run as in eager mode, forward and backward, and every collective they issue is a functional
  collective (``compile_collectives.py``): one graph per module, no graph break inside;
- DTensor outputs leave as local shards and are wrapped again outside.

Gradients therefore are those of eager mode: each parameter's ``.grad`` is a DTensor of its own
layout. ``torch.compile(module)`` written directly still works, with a graph break at each
DTensor call (``dtensor_base.py`` runs those eagerly); ``compile_module`` is the no-break path.
"""
import enum
import functools
import types
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from hyper_parallel.platform.torch.dtensor_base import TorchDTensorBase


def _describe(leaf):
    """A DTensor leaf's layout (how to wrap its shard again), or None for a plain tensor."""
    if isinstance(leaf, TorchDTensorBase):
        return (type(leaf), leaf.device_mesh, tuple(leaf.placements), tuple(leaf.shape),
                tuple(leaf.stride()), leaf.requires_grad)
    return None


def _wrap(local, desc):
    cls, mesh, placements, shape, stride, _ = desc
    return cls.from_local(local, mesh, list(placements), shape=shape, stride=stride)


class _Described:
    """An argument that describes itself to the graph (``hp_graph_parts()``, e.g. Hugging Face's
    MaskSpec): equal, for the signature key, when its description is; its tensors are graph inputs
    and ``rebuild`` makes it again from the traced ones."""

    def __init__(self, description: Any, count: int, rebuild: Callable[[List[Any]], Any]) -> None:
        self.description, self.count, self.rebuild = description, count, rebuild

    def __eq__(self, other):
        return isinstance(other, _Described) and \
            (self.description, self.count) == (other.description, other.count)

    def __hash__(self):
        return hash((self.description, self.count))


def _expand(leaves: List[Any]) -> List[Any]:
    """``leaves`` with each self-describing argument replaced by its ``_Described`` and its tensors
    appended at the end (after the pytree's own leaves)."""
    leaves, extra = list(leaves), []
    for i, leaf in enumerate(leaves):
        parts = getattr(leaf, "hp_graph_parts", None)
        if parts is not None and not isinstance(leaf, torch.Tensor):
            description, tensors, rebuild = parts()
            leaves[i] = _Described(description, len(tensors), rebuild)
            extra.extend(tensors)
    return leaves + extra


def _restore(leaves: List[Any], count: int) -> List[Any]:
    """The pytree's ``count`` leaves, self-describing arguments rebuilt from the appended tensors."""
    extra, out = count, list(leaves[:count])
    for i, leaf in enumerate(out):
        if isinstance(leaf, _Described):
            out[i] = leaf.rebuild(list(leaves[extra:extra + leaf.count]))
            extra += leaf.count
    return out


class _Signature:
    """One call signature: which flat leaves are tensors (and their layouts), the constants, and
    (filled while tracing) the outputs' structure."""

    def __init__(self, spec, leaves):
        self.spec = spec
        self.count = spec.num_leaves
        self.constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self.slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.layouts = [_describe(leaves[i]) for i in self.slots]
        self.out_spec = None
        self.out_layouts = None
        self.out_constants = None

    def key(self, leaves):
        """Layouts, constants and every tensor's shape / dtype / requires_grad: outputs' global
        shapes are read while tracing, so each key gets its own graph (no shape-polymorphic reuse)."""
        tensors = tuple((tuple(leaves[i].shape), leaves[i].dtype, leaves[i].requires_grad)
                        for i in self.slots)
        return (self.spec, tuple(self.constants), tuple(self.layouts), tensors)


_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                   torch.memory_format, torch.layout, enum.Enum)


def _mutable_argument(leaves):
    """The first non-tensor argument that is not a plain immutable value (a KV cache, a user
    object), or None. The trace bakes such a value in and would mutate it only once, at trace time:
    a call carrying one runs eagerly."""
    for value in leaves:
        if not isinstance(value, (torch.Tensor, _Described) + _CONSTANT_TYPES):
            return value
    return None


_SETTING_TYPES = (bool, int, float, str, type(None))
_MAX_SIGNATURES = 16   # a setting that changes on every call would otherwise recompile forever


def _settings(module: torch.nn.Module) -> tuple:
    """The public plain-valued attributes of ``module`` and its sub-modules (``training``, an
    attention's ``is_causal`` or ``window``...): forward reads them while it is traced and the graph
    keeps what it read, so they are part of the key: a change recompiles, and the trace-time checks
    (SPEC §19's agreement) run again with the new value."""
    return tuple((name, tuple(sorted((k, v) for k, v in m.__dict__.items()
                                     if type(v) in _SETTING_TYPES and not k.startswith("_"))))
                 for name, m in module.named_modules())


def _user_error(exc: Optional[BaseException]) -> Optional[ValueError]:
    """The library's ValueError (bad input, ranks that disagree) behind a compile failure, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ValueError):
            return exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


class CompiledParallelModule:
    """``module``'s forward, compiled as described in the module docstring; one compiled graph per
    call signature (tensor layouts, non-tensor arguments, self-describing arguments, the modules'
    plain settings: docs/compile.md "Signatures"), made at its second call (the first runs
    eagerly). Use through ``compile_module``."""

    def __init__(self, module: torch.nn.Module, forward: Callable, compile_kwargs: Dict[str, Any]):
        self.module = module
        self.forward = forward
        self.compile_kwargs = compile_kwargs
        self.compiled: Dict[Any, Callable] = {}
        self._last = None
        self._warned: set = set()

    def _state(self):
        return dict(self.module.named_parameters(remove_duplicate=False)), \
            dict(self.module.named_buffers(remove_duplicate=False))

    def _prepare(self, args, kwargs):
        """This call's signature (a cached one if seen before), its region and compiled function,
        and its tensors as local shards (``to_local``: differentiable, eager)."""
        params, buffers = self._state()
        leaves, spec = tree_flatten((params, buffers, args, kwargs))
        leaves = _expand(leaves)
        signature = _Signature(spec, leaves)
        key = (signature.key(leaves), _settings(self.module))
        entry = self.compiled.get(key)
        if entry is None and len(self.compiled) >= _MAX_SIGNATURES:
            if "limit" not in self._warned:
                self._warned.add("limit")
                warnings.warn(f"compile_module: {type(self.module).__name__} has {_MAX_SIGNATURES} compiled "
                              f"signatures (shapes, layouts, settings); new ones run eagerly; "
                              f"docs/compile.md")
            return None, None
        if entry is None:
            region = self._build(signature)
            entry = self.compiled[key] = (signature, region, torch.compile(region, **self.compile_kwargs),
                                          {"traced": False, "eager": None, "calls": 0})
        signature = entry[0]
        flat_in = [leaves[i] for i in signature.slots]
        flat_in = [x.to_local() if layout is not None else x for x, layout in zip(flat_in, signature.layouts)]
        return entry, flat_in

    def __call__(self, *args, **kwargs):
        mutable = _mutable_argument(_expand(tree_flatten((args, kwargs))[0]))
        if mutable is not None:
            if type(mutable) not in self._warned:
                self._warned.add(type(mutable))
                warnings.warn(f"compile_module: {type(self.module).__name__} runs eagerly when called with a "
                              f"{type(mutable).__name__} argument (state a compiled graph would update only "
                              f"while tracing); docs/compile.md")
            return self.forward(*args, **kwargs)
        entry, flat_in = self._prepare(args, kwargs)
        if entry is None:
            return self.forward(*args, **kwargs)
        signature, _, fn, state = entry
        state["calls"] += 1
        if state["eager"] is not None or state["calls"] == 1:
            # the first call of a signature runs eagerly: SPEC §19's first-call checks (ranks that
            # disagree on a setting, a shape) exchange real values there, which a trace cannot; the
            # graph is made at the second call, its checks then on the keys this call verified
            return self.forward(*args, **kwargs)
        self._last = (entry[1], [(x.shape, x.dtype, x.requires_grad) for x in flat_in])
        try:
            flat_out = fn(*flat_in)
        except (torch._dynamo.exc.TorchRuntimeError, torch._dynamo.exc.BackendCompilerFailed) as exc:
            error = _user_error(exc)
            if error is not None:   # a refusal (every rank alike): the user's error, not a compile failure
                raise error from exc
            if state["traced"]:
                raise
            # the block reads a tensor's value on the host while tracing (expert routing counts):
            # every rank fails alike before any collective ran, so every rank runs it eagerly
            state["eager"] = str(exc).strip().splitlines()[0]
            warnings.warn(f"compile_module: {type(self.module).__name__} runs eagerly for this call "
                          f"signature, it cannot be traced ({state['eager']}); docs/compile.md")
            return self.forward(*args, **kwargs)
        state["traced"] = True
        outs = list(signature.out_constants)
        slots = [i for i, c in enumerate(outs) if c is _TENSOR]
        for slot, value, layout in zip(slots, flat_out, signature.out_layouts):
            outs[slot] = value if layout is None else _wrap(value, layout)
        return tree_unflatten(outs, signature.out_spec)

    def explain(self, *args, **kwargs):
        """``torch._dynamo.explain`` of the region this call compiles to (graphs, graph breaks);
        without arguments, of the last call's region, on zeros of its inputs' shapes (the call's own
        tensors may be gone: fully_shard frees unsharded parameters after forward)."""
        if args or kwargs:
            entry, flat_in = self._prepare(args, kwargs)
            if entry is None:
                raise ValueError(f"explain: {type(self.module).__name__} has {_MAX_SIGNATURES} compiled "
                                 f"signatures already; a call with these arguments runs eagerly")
            region = entry[1]
        else:
            if self._last is None:
                raise ValueError("explain(): no compiled call yet (a signature's first call runs eagerly); "
                                 "call the block twice or pass a call's arguments")
            region, meta = self._last
            flat_in = [torch.zeros(shape, dtype=dtype).requires_grad_(grad) for shape, dtype, grad in meta]
        return torch._dynamo.explain(region)(*flat_in)

    def _build(self, signature: _Signature):
        module, forward = self.module, self.forward

        def traced(*tensors):
            leaves = list(signature.constants)
            for slot, value, layout in zip(signature.slots, tensors, signature.layouts):
                leaves[slot] = value if layout is None else _wrap(value, layout)
            params, buffers, args, kwargs = tree_unflatten(_restore(leaves, signature.count), signature.spec)
            with _reparametrize_module(module, {**params, **buffers}):
                out = forward(*args, **kwargs)
            out_leaves, out_spec = tree_flatten(out)
            signature.out_spec = out_spec
            signature.out_constants = [_TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]
            tensors_out = [x for x in out_leaves if isinstance(x, torch.Tensor)]
            signature.out_layouts = [_describe(x) for x in tensors_out]
            return tuple(x.to_local() if isinstance(x, TorchDTensorBase) else x for x in tensors_out)

        opaque = torch._dynamo.allow_in_graph(traced)

        def region(*tensors):
            return opaque(*tensors)
        # dynamo caches compiled code per code object (8 entries): each region gets its own, so
        # every decoder layer and signature keeps its graph
        _REGIONS[0] += 1
        code = region.__code__.replace(co_name=f"hp_compiled_region_{_REGIONS[0]}")
        return types.FunctionType(code, region.__globals__, code.co_name, None, region.__closure__)


_TENSOR = object()   # an output slot holding a tensor
_REGIONS = [0]       # regions built so far (their code objects' names)


def compile_module(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Compile ``module`` (parallelized or not) in place: its forward runs as one compiled graph
    with the DTensor dispatch, collectives included, traced inside (module docstring).
    ``compile_kwargs`` go to ``torch.compile`` (backend, mode, dynamic...). Returns ``module``."""
    if getattr(module, "_hp_compiled", None) is not None:
        return module
    compiled = CompiledParallelModule(module, module.forward, dict(compile_kwargs))
    setattr(module, "_hp_compiled", compiled)
    module.forward = functools.wraps(module.forward)(compiled)
    return module


def compiled_of(module: torch.nn.Module) -> Optional[CompiledParallelModule]:
    """The compiled call installed by ``compile_module`` (tests read its graphs), or None."""
    return getattr(module, "_hp_compiled", None)
