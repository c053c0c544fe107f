"""einsum(equation, *operands): any number of operands, ``...`` and implicit outputs.

Each letter of the equation is one index; per mesh dim the candidates are:

* everything replicated;
* one letter split on every operand that has it (operands without it replicated): the output is
  split on that letter's dim when the output has it, else each rank holds a Partial(sum) of the
  contraction over its range. A letter whose size is 1 in some operand (broadcast) leaves that
  operand replicated. Letters repeated within one operand (diagonals) are never split;
* one Partial(sum / avg) operand times replicated others: einsum is linear in each operand, so the
  output is the same Partial.

The cheapest candidate wins (strategy_search.py). Every operand split on a letter gets the same
kind of shard, so their pieces line up; the local einsum is the equation itself.
"""
from typing import Any
from hyper_parallel.core.dtensor.layout import numel, shard_orders
from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.ops.strategy_search import pick
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard


def _subscripts(term, ndim):
    """The index of every dim of an operand of rank ``ndim``; ``...`` becomes one private index per
    dim, counted from the right so that broadcast ellipsis dims share an index."""
    term = term.replace(" ", "")
    if "..." not in term:
        return list(term)
    head, tail = term.split("...")
    n = ndim - len(head) - len(tail)
    return list(head) + [f"...{n - i}" for i in range(n)] + list(tail)


def parse_equation(equation: Any, ranks: Any, out_ndim: Any) -> Any:
    """(the index list of every operand, the output's) or None if the equation does not parse."""
    if not isinstance(equation, str):
        return None
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return None
    ops = [_subscripts(t, r) for t, r in zip(terms, ranks)]
    if any(len(o) != r for o, r in zip(ops, ranks)):
        return None
    if "->" in equation:
        out = _subscripts(rhs, out_ndim)
    else:
        letters = [i for o in ops for i in o if not i.startswith("...")]
        ellipsis = sorted({i for o in ops for i in o if i.startswith("...")}, key=lambda i: -int(i[3:]))
        out = ellipsis + sorted(i for i in set(letters) if letters.count(i) == 1)
    return (ops, out) if len(out) == out_ndim else None


def _letter_candidate(index, ops, out, specs, m, out_shape):
    """The candidate splitting ``index`` on mesh dim ``m``, or None if it cannot be split."""
    holders = [k for k, o in enumerate(ops) if index in o]
    if any(ops[k].count(index) > 1 for k in holders) or out.count(index) > 1:
        return None
    sizes = {specs[k].shape[ops[k].index(index)] for k in holders}
    full = max(sizes)
    if len(sizes - {1}) > 1 or full <= 1:
        return None
    kind = next((specs[k].placements[m] for k in holders
                 if specs[k].placements[m].is_shard(ops[k].index(index))), Shard(0))
    inputs = []
    for k, o in enumerate(ops):
        split = index in o and specs[k].shape[o.index(index)] == full
        inputs.append(kind.with_dim(o.index(index)) if split else Replicate())
    output = kind.with_dim(out.index(index)) if index in out else Partial("sum")
    if index in out and out_shape[out.index(index)] != full:
        return None
    return inputs, output


def _candidates(ops, out, specs, m, out_shape):
    n = len(specs)
    cands = [([Replicate()] * n, Replicate())]
    for index in sorted({i for o in ops for i in o}):
        cand = _letter_candidate(index, ops, out, specs, m, out_shape)
        if cand is not None:
            cands.append(cand)
    for k, s in enumerate(specs):
        p = s.placements[m]
        if p.is_partial() and p.reduce_op in ("sum", "avg"):
            cands.append(([p if j == k else Replicate() for j in range(n)], p))
    return cands


@register_rule("einsum")
def einsum_rule(call: Any) -> Any:
    operands = list(call.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    specs = [call.spec(t) for t in operands]
    if not operands or any(s is None for s in specs) or len(call.specs) != len(specs) or call.kwargs:
        return None
    if len({id(t) for t in operands}) != len(operands):
        return None  # one tensor as two operands: it would need two layouts at once
    out_shape = tuple(call.out_shapes[0])
    parsed = parse_equation(call.args[0], [s.ndim for s in specs], len(out_shape))
    if parsed is None:
        return None
    ops, out = parsed
    chosen_in: list[list[Any]] = [[] for _ in specs]
    chosen_out: list[Any] = []
    for m in range(call.mesh_ndim):
        inputs, output = pick(_candidates(ops, out, specs, m, out_shape), [s.placements[m] for s in specs],
                              [numel(s.shape) for s in specs], call.mesh.size(m))
        for k, p in enumerate(inputs):
            chosen_in[k].append(p)
        chosen_out.append(output)
    try:  # a StridedShard whose partner mesh dim chose something else: no coherent layout
        for placements, s in zip(chosen_in, specs):
            shard_orders(placements, call.mesh.mesh_shape, s.ndim)
        shard_orders(chosen_out, call.mesh.mesh_shape, len(out_shape))
    except ValueError:
        rep = (Replicate(),) * call.mesh_ndim
        return OpStrategy(inputs=[rep] * len(specs), outputs=rep)
    inputs = [None] * len(call.specs)
    for t, placements in zip(operands, chosen_in):
        inputs[call.index(t)] = tuple(placements)
    return OpStrategy(inputs=inputs, outputs=tuple(chosen_out))


__all__ = ["einsum_rule", "parse_equation"]
