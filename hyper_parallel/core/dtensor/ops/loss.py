"""cross_entropy(input, target, ...) on DTensors.

The class dim is dim 1 of the logits (dim 0 for 1-D logits).

* Ordinarily the logits and the target are replicated and the op runs on whole tensors: always
  correct, whatever the layout.
* Inside ``loss_parallel()`` (``hyper_parallel.core.tensor_parallel``), logits whose class dim is
  sharded on a mesh dim (vocab-parallel: the ``Shard(-1)`` output of a ColwiseParallel head) stay
  sharded. Each rank computes on its class range ``[c0, c0 + C_local)``:

      m      = all_reduce_max(max_c x)                  (a constant shift: no gradient)
      s      = sum_c exp(x - m)                          \
      x_t    = x[target] - m on the rank owning target    } one all-reduce(sum), stacked
      sum_x  = sum_c (x - m)       (label smoothing)     /
      nll    = log(s) - x_t
      smooth = C * log(s) - sum_x                          (= -sum_c log p_c)
      loss   = (1 - eps) * nll + eps / C * smooth

  The all-reduce is the platform's differentiable one with an identity backward: the loss is
  replicated, so every rank already holds the whole gradient of each summed piece. The gradient
  of the local logits (softmax - one_hot, on the local classes) then needs no communication.
  Probability targets (same shape as the logits) are sharded like the logits:
  loss = log(s) * sum_c t_c - sum_c t_c (x_c - m), with t smoothed first.
  ``weight=`` and the legacy ``size_average``/``reduce`` arguments take the replicated path.
"""
from typing import Any
import threading

from hyper_parallel.core.dtensor.ops.registry import OpStrategy, register_rule
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.platform import get_platform

_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
         "label_smoothing")
_DEFAULTS = {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0}

_state = threading.local()


def enter_loss_parallel() -> None:
    _state.depth = getattr(_state, "depth", 0) + 1


def exit_loss_parallel() -> None:
    _state.depth = max(getattr(_state, "depth", 0) - 1, 0)


def loss_parallel_enabled() -> bool:
    return getattr(_state, "depth", 0) > 0


def _values(args, kwargs):
    vals = {name: (args[i] if i < len(args) else kwargs.get(name, _DEFAULTS.get(name)))
            for i, name in enumerate(_ARGS)}
    if vals["reduction"] is None:
        vals["reduction"] = "mean"
    if vals["ignore_index"] is None:
        vals["ignore_index"] = -100
    return vals


def _replicated(call):
    rep = tuple(Replicate() for _ in range(call.mesh_ndim))
    return OpStrategy(inputs=[rep] * len(call.specs), outputs=rep)


@register_rule("cross_entropy", cacheable=False)  # reads whether loss_parallel() is on
def cross_entropy_rule(call: Any) -> Any:
    v = _values(call.args, call.kwargs)
    x, target = v["input"], v["target"]
    xs = call.spec(x)
    if xs is None or xs.ndim == 0:
        return _replicated(call)
    class_dim = 0 if xs.ndim == 1 else 1
    vocab_mesh_dim = None
    if loss_parallel_enabled() and v["weight"] is None and v["size_average"] is None and v["reduce"] is None \
            and v["reduction"] in ("mean", "sum", "none"):
        for m, p in enumerate(xs.placements):
            if type(p) is Shard and p.dim == class_dim:  # not a StridedShard / HeadTailShard
                vocab_mesh_dim = m
                break
    if vocab_mesh_dim is None:
        return _replicated(call)

    ts = call.spec(target)
    target_shape = tuple(getattr(target, "shape", ()))
    soft = target_shape == tuple(xs.shape) and get_platform().is_floating_point(target)
    if not _vocab_parallel_arguments_valid(v, xs, target_shape, soft, class_dim):
        return _replicated(call)   # the framework's own op raises its own error on whole tensors
    x_t = tuple(xs.placements[m] if m == vocab_mesh_dim else Replicate() for m in range(call.mesh_ndim))
    inputs: list[Any] = [None] * len(call.specs)
    inputs[call.index(x)] = x_t
    if ts is not None:
        inputs[call.index(target)] = x_t if soft else tuple(Replicate() for _ in range(call.mesh_ndim))
    start, size = xs.with_placements(x_t).local_box()[class_dim]
    local = _vocab_parallel_local(call.mesh.get_group(vocab_mesh_dim), class_dim, start, size,
                                  xs.shape[class_dim], soft)
    return OpStrategy(inputs=inputs, outputs=tuple(Replicate() for _ in range(call.mesh_ndim)), local=local)


def _vocab_parallel_arguments_valid(v, xs, target_shape, soft, class_dim):
    """Shapes, target dtype and label_smoothing the vocab-parallel path can take as given; anything
    else goes to the whole-tensor op, which rejects it exactly as on one device."""
    eps = v["label_smoothing"]
    if eps is not None and not 0.0 <= float(eps) <= 1.0:
        return False
    target = v["target"]
    if soft or not get_platform().is_tensor(target):
        return soft
    label_shape = tuple(xs.shape[:class_dim]) + tuple(xs.shape[class_dim + 1:])
    return target_shape == label_shape and not get_platform().is_floating_point(target)


def _check_labels(target, num_classes, ignore_index):
    """Labels outside [0, C) that are not ignore_index raise IndexError, as on one device. The
    labels are replicated (the rule asks for it), so every rank takes the same decision before any
    collective: no rank is left waiting. Cost: one device-to-host read of a boolean per call (a
    stream sync on an accelerator; free on CPU), the price of an exact error."""
    bad = (target < 0) | (target >= num_classes)
    if ignore_index is not None:
        bad = bad & (target != ignore_index)
    if bool(bad.any()):
        first = int(target[bad].reshape(-1)[0].item())
        raise IndexError(f"Target {first} is out of bounds.")


def _vocab_parallel_local(group, class_dim, start, size, num_classes, soft):
    """The loss from this rank's vocab columns [start, start + size): one max all-reduce for the
    shift, then one sum all-reduce of the per-token pieces (exp-sum, the label's logit, the
    smoothing sums), from which every rank finishes the same loss."""
    platform = get_platform()

    def vocab_parallel_cross_entropy(call, args, kwargs):
        v = _values(args, kwargs)
        x, target = v["input"], v["target"]
        eps = float(v["label_smoothing"] or 0.0)
        if not soft:
            _check_labels(target, num_classes, v["ignore_index"])
        shifted = x - _global_max(platform, x, group, class_dim, size)
        pieces = _pieces(shifted, target, class_dim, start, size, num_classes, soft, eps)
        stacked = platform.cat([p.unsqueeze(-1) for p in pieces], dim=-1).contiguous()
        total = platform.differentiable_all_reduce(stacked, group, "sum", backward="identity")
        if soft:
            return _finish_soft(total, v["reduction"])
        return _finish_labels(total, target, v["ignore_index"], v["reduction"], eps, num_classes)

    return vocab_parallel_cross_entropy


def _global_max(platform, x, group, class_dim, size):
    """The per-token shift: any constant works (the loss does not depend on it); the global max
    keeps exp() in range. No gradient flows through it."""
    if size > 0:
        m_local = x.detach().amax(dim=class_dim, keepdim=True)
    else:
        m_local = x.detach().sum(dim=class_dim, keepdim=True) - float("inf")
    return platform.all_reduce(m_local.contiguous(), group, "max")


def _pieces(shifted, target, class_dim, start, size, num_classes, soft, eps):
    """This rank's share of each per-token sum the loss needs (summed over ranks afterwards)."""
    pieces = [shifted.exp().sum(dim=class_dim)]
    if soft:
        t = target
        if eps > 0:
            t = t * (1.0 - eps) + eps / num_classes
        return pieces + [t.sum(dim=class_dim), (t * shifted).sum(dim=class_dim)]
    in_range = (target >= start) & (target < start + size)
    if size > 0:
        idx = (target - start).masked_fill(~in_range, 0)
        picked = shifted.gather(class_dim, idx.unsqueeze(class_dim)).squeeze(class_dim)
        pieces.append(picked.masked_fill(~in_range, 0.0))
    else:
        pieces.append(shifted.sum(dim=class_dim) * 0.0)
    if eps > 0:
        pieces.append(shifted.sum(dim=class_dim))
    return pieces


def _reduce(loss, reduction):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / loss.numel()


def _finish_soft(total, reduction):
    lse = total[..., 0].log()
    return _reduce(lse * total[..., 1] - total[..., 2], reduction)


def _finish_labels(total, target, ignore_index, reduction, eps, num_classes):
    lse = total[..., 0].log()
    valid = target != ignore_index
    nll = (lse - total[..., 1]).masked_fill(~valid, 0.0)
    smooth = None
    if eps > 0:
        smooth = (num_classes * lse - total[..., 2]).masked_fill(~valid, 0.0)
    if reduction == "none":
        return nll if smooth is None else (1.0 - eps) * nll + (eps / num_classes) * smooth
    nll, smooth = nll.sum(), (smooth.sum() if smooth is not None else None)
    if reduction == "mean":
        count = valid.sum().to(nll.dtype)
        nll, smooth = nll / count, (smooth / count if smooth is not None else None)
    return nll if smooth is None else (1.0 - eps) * nll + (eps / num_classes) * smooth


__all__ = ["cross_entropy_rule", "loss_parallel_enabled", "enter_loss_parallel", "exit_loss_parallel"]
