"""F.dropout(input, p, training, inplace) and torch.dropout(input, p, train): elementwise.

The output has the input's placements, except that a Partial input is reduced to Replicate first
(a random mask does not commute with the sum over ranks). When dropout is the identity
(``p == 0`` or not training) a Partial input stays Partial and nothing moves.

RNG caveat: every rank draws the mask for its own local shard from its own generator.
* Sharded inputs: the masks of different shards come from the ranks' generators, so the global
  mask is a valid dropout mask (each element kept with probability 1 - p) only when the ranks'
  generators are *independent*; with identically seeded generators, equal-shaped shards get the
  same mask pattern. And the result never equals a single-device dropout of the full tensor with
  the same seed (PyTorch DTensor's offset-based RNG tracker is not implemented here).
* Replicated inputs: every rank computes the whole output, so the masks agree (and the output is
  truly replicated) only when the ranks' generators are in the same state — seed them alike and
  make the same random draws on every rank.
There is no per-placement RNG tracker, so one generator state cannot serve both at once: seed the
ranks differently when dropout runs on sharded activations (the usual case under sequence / tensor
parallelism), alike when it runs on replicated ones. ``inplace=True`` has no rule: it runs at the aten level, where
the mask (``bernoulli_``) takes the warned replicated fallback — each rank draws a full-size mask
and keeps its own slice — and the multiply runs on the shards.
"""
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate


def _is_identity(call):
    training = call.arg(2, "training", call.kwargs.get("train", True))
    p = call.arg(1, "p", 0.5)
    return not training or p == 0


@register_rule("dropout")
def dropout_rule(call):
    x = call.arg(0, "input")
    spec = call.spec(x)
    if spec is None or call.index(x) != 0 or call.arg(3, "inplace", False):
        return None
    identity = _is_identity(call)
    placements = tuple(Replicate() if p.is_partial() and not identity else p for p in spec.placements)
    return OpStrategy(inputs=[placements] + [None] * (len(call.specs) - 1), outputs=placements)


__all__ = ["dropout_rule"]
