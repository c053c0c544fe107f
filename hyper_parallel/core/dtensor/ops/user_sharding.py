"""``register_sharding``: user-registered sharding strategies, with PyTorch's contract.

The registered function takes the op's arguments, each DTensor replaced by its ``DTensorSpec``
(``shape``, ``ndim``, ``placements``, ``mesh``), and returns the acceptable shardings for ONE mesh
dim: a list of ``(output placements, input placements)``, one output placement per op output and
one input placement per positional argument (None for a non-tensor). On an n-D mesh each mesh dim
independently takes the acceptable sharding that moves the fewest bytes from the inputs' current
placements (``strategy_search.pick``).

What ``op`` may be:
- a framework-neutral op name (``"softmax"``, as ``register_rule`` uses): the registration
  replaces the built-in rule of that user-level op, on every platform;
- an op object that reaches DTensors below autograd (torch: an ``OpOverload`` such as
  ``torch.ops.mylib.op.default``, e.g. a ``torch.library.custom_op``): it runs on the shards in the
  chosen layout instead of the replicated fallback. (A built-in user-level op is decided above
  that level: register it by name.)
- a list of these.
"""
from typing import Any
from hyper_parallel.core.dtensor.dispatch import decision_cache
from hyper_parallel.core.dtensor.ops import registry
from hyper_parallel.core.dtensor.ops.registry import OpStrategy
from hyper_parallel.core.dtensor.ops.strategy_search import pick
from hyper_parallel.core.dtensor.layout import numel
from hyper_parallel.core.dtensor.dispatch.dispatcher import common_mesh, meta_outputs
from hyper_parallel.core.dtensor.dispatch.tree import tree_flatten, tree_unflatten
from hyper_parallel.core.dtensor.dtensor import DTensor, as_layout
from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.platform import get_platform

_BY_NAME: dict[Any, Any] = {}    # neutral op name -> user function (consulted before the built-in rules)
_BY_OP: dict[Any, Any] = {}      # op object (aten level) -> user function


def register_sharding(op: Any) -> Any:
    """Decorator registering a sharding strategy function for ``op`` (see the module docstring)."""
    ops = list(op) if isinstance(op, (list, tuple)) else [op]

    def wrapper(fn):
        for o in ops:
            if isinstance(o, str):
                _BY_NAME[o] = fn
                registry._OVERRIDES[o] = user_rule(o)
            else:
                _BY_OP[o] = fn
        decision_cache.clear()  # decisions cached under the old rule must not be reused
        return fn
    return wrapper


def unregister_sharding(op: Any) -> None:
    """Remove the registrations of ``op`` (a name, an op object or a list); the built-in rule, if
    any, applies again."""
    for o in list(op) if isinstance(op, (list, tuple)) else [op]:
        (_BY_NAME if isinstance(o, str) else _BY_OP).pop(o, None)
        registry._OVERRIDES.pop(o, None)
    decision_cache.clear()


def user_rule(name: str) -> Any:
    """The rule wrapping the user function registered under ``name``, or None."""
    fn = _BY_NAME.get(name)
    return None if fn is None else (lambda call: strategy(fn, name, call.args, call.kwargs, call.dtensors,
                                                          call.mesh, lambda: call.out_shapes))


def user_op_function(op: Any) -> Any:
    return _BY_OP.get(op) if _BY_OP else None


def strategy(fn: Any, name: str, args: Any, kwargs: Any, dtensors: Any, mesh: Any, out_shapes: Any) -> Any:
    """The OpStrategy the user function ``fn`` gives this call: inputs per DTensor of ``dtensors``
    (a DTensor not among the positional arguments is replicated), outputs per output."""
    to_spec = (lambda a: a._spec if isinstance(a, DTensor) else a)
    options = list(fn(*[to_spec(a) for a in args], **{k: to_spec(v) for k, v in kwargs.items()}))
    positions = [i for i, a in enumerate(args) if isinstance(a, DTensor)]
    _check(name, options, args)
    shapes = out_shapes()
    chosen_in: Any = {i: [] for i in positions}
    chosen_out: Any = [[] for _ in shapes]
    for m in range(mesh.ndim):
        candidates = [([_norm(ins[i], args[i].ndim) for i in positions],
                       [_norm(p, len(s)) for p, s in zip(outs, shapes)]) for outs, ins in options]
        current = [args[i]._spec.placements[m] for i in positions]
        numels = [numel(args[i]._spec.shape) for i in positions]
        ins, outs = pick(candidates, current, numels, mesh.mesh_shape[m])
        for i, p in zip(positions, ins):
            chosen_in[i].append(p)
        for j, p in enumerate(outs):
            chosen_out[j].append(p)
    inputs = []
    for d in dtensors:
        where = next((i for i in positions if args[i] is d), None)
        inputs.append(tuple(chosen_in[where]) if where is not None else (Replicate(),) * mesh.ndim)
    outputs = [tuple(p) for p in chosen_out]
    return OpStrategy(inputs=inputs, outputs=outputs if len(outputs) != 1 else outputs[0])


def _norm(p, ndim):
    if p is None:
        return Replicate()
    return p.normalized(ndim) if p.is_shard() else p


def _check(name, options, args):
    if not options:
        raise ValueError(f"register_sharding({name!r}): the strategy function returned no acceptable "
                         f"sharding; return at least one (output placements, input placements) pair")
    for outs, ins in options:
        if len(ins) != len(args):
            raise ValueError(f"register_sharding({name!r}): an acceptable sharding lists {len(ins)} input "
                             f"placements {list(ins)} for {len(args)} positional arguments; give one per "
                             f"argument (None for a non-tensor)")


def run_user_op(fn: Any, func: Any, args: Any, kwargs: Any) -> Any:
    """An op below autograd with a registered strategy: inputs moved to the chosen layout, the op
    run on the shards, its tensor outputs wrapped in the chosen placements (global shapes from a
    meta run)."""
    name = get_platform().op_display_name(func)
    leaves, structure = tree_flatten((args, kwargs))
    mesh = common_mesh(leaves, name)
    dtensors = [x for x in leaves if isinstance(x, DTensor)]
    shapes = meta_outputs(func, args, kwargs)
    plan = strategy(fn, name, args, kwargs, dtensors, mesh, lambda: shapes)
    targets = {id(d): p for d, p in zip(dtensors, plan.inputs)}
    local = [as_layout(x, x._spec.with_placements(targets[id(x)]))._local_tensor
             if isinstance(x, DTensor) else x for x in leaves]
    local_args, local_kwargs = tree_unflatten(local, structure)
    result = func(*local_args, **local_kwargs)
    outs = plan.outputs if isinstance(plan.outputs, list) else [plan.outputs]
    res_leaves, res_structure = tree_flatten(result)
    wrapped, j = [], 0
    for leaf in res_leaves:
        if get_platform().is_tensor(leaf) and j < len(outs):
            leaf = DTensor._make(leaf, DTensorSpec(mesh, outs[j], shapes[j]))
            j += 1
        wrapped.append(leaf)
    return tree_unflatten(wrapped, res_structure)
