"""Run a user-level op on DTensors through its sharding rule.

1. The rule picks the layout of every input and of the outputs.
2. Inputs are redistributed (differentiably) and unwrapped to local shards.
3. The op runs on the shards under the framework's own autograd.
4. Outputs are wrapped with the global shapes the op gives on meta tensors.

Gradients: a local op's gradient for a sharded input is that shard's gradient. A replicated input
whose outputs are split over a mesh dim gets a partial gradient there (each rank saw only part of
the work), so its gradient is tagged Partial(sum) and summed where it is next needed. A Partial
input's gradient is replicated. This gives PyTorch DTensor's gradient semantics without a rule for
any backward op.
"""
import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence

from hyper_parallel.core.agreement_attention import agree_on_repeated_attention
from hyper_parallel.core.bounded_cache import BoundedCache
from hyper_parallel.core.dtensor.dispatch import decision_cache
from hyper_parallel.core.dtensor.aten import writeback
from hyper_parallel.core.dtensor.dispatch.interceptors import screen
from hyper_parallel.core.dtensor.dtensor import DTensor, GradPassThrough, _from_local, _to_local, as_layout
from hyper_parallel.core.dtensor.layout import grad_placements
from hyper_parallel.core.dtensor.ops import get_rule
from hyper_parallel.core.dtensor.ops.registry import OpCall, is_cacheable
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.core.dtensor.dispatch.tree import tree_flatten, tree_unflatten
from hyper_parallel.platform import get_platform


def common_mesh(leaves: Sequence[Any], op_name: str) -> Any:
    mesh = None
    for leaf in leaves:
        if isinstance(leaf, DTensor):
            if mesh is None:
                mesh = leaf._spec.mesh
            elif leaf._spec.mesh != mesh:
                raise ValueError(f"{op_name}: DTensor inputs live on different meshes ({mesh} and "
                                 f"{leaf._spec.mesh}); redistribute them onto one mesh first")
    return mesh


def promote_plain(leaf: Any, mesh: Any) -> Any:
    """A plain tensor beside DTensors is taken as replicated (0-dim ones stay scalars)."""
    if get_platform().is_tensor(leaf) and not isinstance(leaf, DTensor) and leaf.ndim > 0:
        spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(leaf.shape))
        return _from_local(leaf, spec)
    return leaf


def input_grad_placements(placements: Sequence[Any], replicated_out: Any) -> Any:
    out: List[Any] = []
    for m, p in enumerate(placements):
        if p.is_partial():
            out.append(Replicate())
        elif p.is_replicate() and not replicated_out[m]:
            out.append(Partial("sum"))
        else:
            out.append(p)
    return tuple(out)


def ensure_leaf_grad_layout(dtensor: Any) -> None:
    """A leaf's gradient takes the leaf's own placements (PyTorch DTensor semantics), although the
    ops that use it may hand back Partial pieces; converting once, after the engine has summed
    every contribution, costs one reduction per backward instead of one per use."""
    if dtensor.grad_fn is not None or not dtensor.requires_grad or getattr(dtensor, "_hp_hooked", False):
        return
    target = dtensor._spec.with_placements(grad_placements(dtensor._spec.placements))
    dtensor.register_hook(lambda grad: as_layout(grad, target))
    dtensor._hp_hooked = True


_META_CACHE = BoundedCache(65536)


def _meta_key(func, leaves, structure):
    key = [func, repr(structure)]
    for leaf in leaves:
        if isinstance(leaf, DTensor):
            key.append(("D", leaf._spec.shape, leaf.dtype))
        elif get_platform().is_tensor(leaf):
            key.append(("T", tuple(leaf.shape), leaf.dtype))
        else:
            try:
                hash(leaf)
                key.append(leaf)
            except TypeError:  # e.g. slices in an index
                key.append(repr(leaf))
    return tuple(key)


def meta_outputs(func: Callable, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """Global shapes of every tensor output, from running ``func`` once on meta tensors (cached:
    a meta run of a composite op costs milliseconds, a training loop repeats the same calls)."""
    leaves, structure = tree_flatten((args, kwargs))
    key = _meta_key(func, leaves, structure)
    shapes = _META_CACHE.get(key)
    if shapes is None:
        def to_meta(x: Any) -> Any:
            if isinstance(x, DTensor):
                return get_platform().meta_tensor(x._spec.shape, x.dtype)
            if get_platform().is_tensor(x):
                return get_platform().to_meta(x)
            return x
        meta_args, meta_kwargs = tree_unflatten([to_meta(x) for x in leaves], structure)
        with get_platform().no_grad():
            result = func(*meta_args, **meta_kwargs)
        outs, _ = tree_flatten(result)
        shapes = [tuple(o.shape) for o in outs if get_platform().is_tensor(o)]
        _META_CACHE[key] = shapes
    return shapes


def _passthrough(out_placements, input_targets, replicated_out):
    """A GradPassThrough for an op with one tensor output, over the mesh dims where the output and
    every input are replicated (the local backward is then the same linear map on every rank, so a
    Partial(sum) output gradient gives Partial(sum) input gradients); None if there are none. With
    several outputs, one gradient might be partial and another not, so nothing passes through."""
    if len(out_placements) != 1:
        return None
    dims = [m for m, replicated in enumerate(replicated_out)
            if replicated and all(t[m].is_replicate() for t in input_targets)]
    return GradPassThrough(dims) if dims else None


@functools.lru_cache(maxsize=None)
def _inplace_position(func):
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # builtins without a Python signature
        return None
    return params.index("inplace") if "inplace" in params else None


def _asks_in_place(func, args, kwargs):
    """``F.relu(x, inplace=True)`` and the like. Rules compute out of place, so such calls go down
    to the level where in-place ops are handled (and keep their layout and every alias)."""
    if kwargs.get("inplace"):
        return True
    pos = _inplace_position(func)
    return pos is not None and len(args) > pos and bool(args[pos])


def dispatch_function(name: str, func: Callable, args: Sequence[Any], kwargs: Dict[str, Any],
                      record: Optional[Callable] = None) -> Any:
    """``record(args, targets, out_placements, result)``: called (by fast_path.py) when the call
    qualifies for the fast path: see ``_fast_eligible``."""
    leaves, structure = tree_flatten((args, kwargs))
    interceptor = screen(name, leaves)
    rule = get_rule(name)
    # out=: the rules compute a new tensor; the aten level writes it into out (aten_rules.py)
    if rule is None or _asks_in_place(func, args, kwargs) or kwargs.get("out") is not None:
        return NotImplemented
    mesh = common_mesh(leaves, name)
    leaves = [promote_plain(x, mesh) for x in leaves]
    call_args, call_kwargs = tree_unflatten(leaves, structure)
    call = OpCall(name, func, call_args, call_kwargs, mesh, [x for x in leaves if isinstance(x, DTensor)],
                  meta_fn=lambda: meta_outputs(func, call_args, call_kwargs))
    strategy = _decide(call, rule, interceptor, leaves, structure)
    if strategy is None:
        return NotImplemented
    out_placements = strategy.outputs if isinstance(strategy.outputs, list) else \
        [strategy.outputs] * len(call.out_shapes)
    targets = [(strategy.inputs[call.index(leaf)] or leaf._spec.placements) if isinstance(leaf, DTensor)
               else None for leaf in leaves]
    tracked = name in VIEW_OPS and interceptor is None and _tracked(leaves)
    if tracked and (name == "getitem" or _moves(leaves, targets)):
        for leaf in leaves:
            if isinstance(leaf, DTensor):
                ensure_leaf_grad_layout(leaf)
        return NotImplemented  # the aten level takes it as a view autograd knows (see writeback.py)
    wrapped, out_structure, view_base = _run_on_shards(call, strategy, leaves, structure, targets,
                                                       out_placements, tracked)
    if interceptor is not None and name in interceptor.pass_through:
        interceptor.passed(call, leaves, [out for out in wrapped if isinstance(out, DTensor)])
    if view_base is not None:
        _mark_views(wrapped, view_base, func, args, kwargs, autograd_view=False)
    result = tree_unflatten(wrapped, out_structure)
    if record is not None and _fast_eligible(call, strategy, interceptor, leaves, targets, out_structure):
        record(args, targets, out_placements, result)
    return result


def _fast_eligible(call, strategy, interceptor, leaves, targets, out_structure):
    """A call fast_path.py may repeat as local op -> wrap: a cached decision (no interceptor), one
    tensor output, no view semantics, no rule-supplied local function, every input already placed."""
    return (interceptor is None and out_structure is None and strategy.local is None
            and call.name not in VIEW_OPS and is_cacheable(call.name) and not _moves(leaves, targets))


def _decide(call, rule, interceptor, leaves, structure):
    """The call's strategy: the interceptor's, a cached decision, or the rule's (then cached)."""
    if interceptor is not None and call.name in interceptor.consumers:
        strategy = interceptor.strategy(call)
        if strategy is not None:
            return strategy
    key = None
    if interceptor is None and is_cacheable(call.name):
        key = decision_cache.signature(call.name, call.func, call.mesh, leaves, structure,
                                       get_platform().is_tensor, DTensor)
        found = decision_cache.lookup(key)
        if found is not None:
            agree_on_repeated_attention(call)   # the rule's agreement check, for the call site's sequence
            call.set_out_shapes(found[1])
            return found[0]
    decision_cache.STATS["rule_evaluations"] += 1
    strategy = rule(call)
    if key is not None and strategy is not None:
        decision_cache.store(key, strategy, call.out_shapes)
    return strategy


def _run_on_shards(call, strategy, leaves, structure, targets, out_placements, tracked):
    """Redistribute the inputs (differentiably), run the op on the shards, wrap the outputs.
    Returns (output leaves, their structure, the input a view op's outputs must write back to)."""
    mesh = call.mesh
    replicated_out = [all(p[m].is_replicate() for p in out_placements) for m in range(mesh.ndim)]
    passthrough = _passthrough(out_placements, [t for t in targets if t is not None], replicated_out)
    locals_, view_base = [], None
    for leaf, target in zip(leaves, targets):
        if isinstance(leaf, DTensor):
            ensure_leaf_grad_layout(leaf)
            moved = leaf if target == leaf._spec.placements else leaf.redistribute(placements=target)
            chained = moved is not leaf or tracked or writeback.is_marked(leaf)
            if chained and call.name in VIEW_OPS and view_base is None:
                view_base = leaf
            grad_spec = moved._spec.with_placements(input_grad_placements(target, replicated_out))
            leaf = _to_local(moved, grad_spec, passthrough)
        locals_.append(leaf)
    local_args, local_kwargs = tree_unflatten(locals_, structure)
    if strategy.local is not None:
        result = strategy.local(call, local_args, local_kwargs)
    else:
        result = call.func(*local_args, **local_kwargs)
    out_leaves, out_structure = tree_flatten(result)
    wrapped, k = [], 0
    for out in out_leaves:
        if get_platform().is_tensor(out):
            spec = DTensorSpec(mesh, tuple(out_placements[k]), call.out_shapes[k])
            out = _from_local(out, spec, passthrough)
            k += 1
        wrapped.append(out)
    return wrapped, out_structure, view_base


# Ops whose torch result is a view of their input: when the rule had to move the input first, the
# result is a copy, and an in-place write into it must still reach the input (writeback.py).
VIEW_OPS = frozenset({"view", "expand", "transpose", "permute", "movedim", "t", "split", "chunk", "unbind",
                      "narrow", "getitem"})


def _tracked(leaves):
    """Whether autograd tracks a DTensor input. A view this level takes of it is a view only in name
    (the wrapper is a new autograd node), so a write through it could not reach the input's
    gradient. Indexing (``x[:, 1] += 1``, ``v = x[2:]; v.mul_(3)``) and views that move data are
    therefore left to the aten level, where autograd records them as views; the remaining views of
    tracked inputs are marked, and a write through them raises (writeback.check_writable)."""
    return get_platform().is_grad_enabled() and \
        any(isinstance(x, DTensor) and x.requires_grad for x in leaves)


def _moves(leaves, targets):
    return any(isinstance(leaf, DTensor) and target != leaf._spec.placements
               for leaf, target in zip(leaves, targets))


def _mark_views(outputs, base, func, args, kwargs, autograd_view):
    rest = args[1:]
    index = [i for i, out in enumerate(outputs) if isinstance(out, DTensor)]
    for k, i in enumerate(index):
        region = (lambda full, k=k: [o for o in tree_flatten(func(full, *rest, **kwargs))[0]
                                     if get_platform().is_tensor(o)][k])
        writeback.mark(outputs[i], base, region, autograd_view)
