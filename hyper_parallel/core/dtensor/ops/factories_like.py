"""new_zeros / new_ones / new_full / new_empty on a DTensor (PyTorch DTensor's semantics).

* The requested size is the input's global size and the input is sharded (for new_empty: in any
  layout): the output takes the input's layout and each rank allocates only its piece. A Partial
  input gives a Replicate output for the initialised factories (ones on every rank of a
  Partial(sum) would sum to ``n`` times the value); new_empty keeps even Partial (its memory is
  about to be overwritten in that layout).
* Otherwise the output is a Replicate tensor of the requested size, made on every rank from its
  own shard (only dtype / device are read from it): nothing is gathered.
"""
from typing import Any
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate


def _size_and_rest(name, args):
    """(size, the positional arguments after it) of ``x.new_zeros(size)`` / ``x.new_zeros(2, 3)`` /
    ``x.new_full(size, fill)``."""
    if len(args) > 1 and isinstance(args[1], (list, tuple)) or name == "new_full" or len(args) <= 1:
        return (tuple(args[1]) if len(args) > 1 else None), tuple(args[2:])
    return tuple(args[1:]), ()


@register_rule("new_factory")
def new_factory_rule(call: Any) -> Any:
    x = call.args[0] if call.args else None
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or len(call.specs) != 1:
        return None
    kind = call.func.__name__
    out_shape = tuple(call.out_shapes[0])
    uninitialised = kind == "new_empty"
    follows = out_shape == tuple(spec.shape) and (
        uninitialised or any(p.is_shard() for p in spec.placements))
    if not follows:
        rep = (Replicate(),) * call.mesh_ndim
        return OpStrategy(inputs=[None], outputs=rep)
    outputs = tuple(p if p.is_shard() or uninitialised else Replicate() for p in spec.placements)

    def new_factory_on_shard(call_, args, kwargs):
        _, rest = _size_and_rest(kind, args)
        kwargs = {k: v for k, v in kwargs.items() if k != "size"}
        return call_.func(args[0], tuple(args[0].shape), *rest, **kwargs)
    return OpStrategy(inputs=[None], outputs=outputs, local=new_factory_on_shard)


__all__ = ["new_factory_rule"]
