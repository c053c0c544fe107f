"""In-place ops that change a DTensor's shape, not its values: ``transpose_``, ``t_``,
``swapdims_``, ``unsqueeze_``, ``squeeze_``.

Composite torch ops use them on their temporaries (group norm unsqueezes in place, stft transposes
in place), so they must work. Each is a pure relabelling of dims: the local shard takes the same
in-place op, the placements follow their dims, and the platform updates the wrapper's own shape.
No data moves. A squeeze of a dim that a mesh dim splits (a size-1 dim whose trailing pieces are
empty) and the ops that reallocate or restride (``resize_``, ``as_strided_``, ``set_``) raise.
"""
from typing import Any
from hyper_parallel.core.dtensor.placement_types import normalize_placements
from hyper_parallel.core.dtensor.spec import DTensorSpec
from hyper_parallel.platform import get_platform


def _dim(d, ndim):
    return d % ndim if ndim else 0


def _permuted(placements, perm):
    """Placements after output dim i takes input dim perm[i]."""
    where = {src: i for i, src in enumerate(perm)}
    return tuple(p.with_dim(where[p.dim]) if p.is_shard() else p for p in placements)


def _transpose(spec, d0, d1):
    perm = list(range(spec.ndim))
    if spec.ndim:
        a, b = _dim(d0, spec.ndim), _dim(d1, spec.ndim)
        perm[a], perm[b] = perm[b], perm[a]
    return _permuted(spec.placements, perm)


def _unsqueeze(spec, d):
    d = _dim(d, spec.ndim + 1)
    return tuple(p.with_dim(p.dim + 1) if p.is_shard() and p.dim >= d else p for p in spec.placements)


def _squeeze(spec, dims, name):
    if dims is None:
        dims = [d for d, size in enumerate(spec.shape) if size == 1]
    dims = {_dim(d, spec.ndim) for d in ([dims] if isinstance(dims, int) else dims)}
    dims = {d for d in dims if spec.shape[d] == 1}
    if any(p.is_shard() and p.dim in dims for p in spec.placements):
        raise NotImplementedError(f"{name} of a dim split by a mesh dim ({spec.placements}): redistribute "
                                  f"that mesh dim to Replicate first")
    return tuple(p.with_dim(p.dim - sum(1 for d in dims if d < p.dim)) if p.is_shard() else p
                 for p in spec.placements)


def new_placements(name: str, spec: Any, args: Any) -> Any:
    """The target's placements after the op, or None if the op is not a relabelling of dims."""
    if name in ("transpose_", "swapdims_", "swapaxes_"):
        return _transpose(spec, args[1], args[2])
    if name == "t_":
        return _transpose(spec, 0, 1)
    if name == "unsqueeze_":
        return _unsqueeze(spec, args[1])
    if name == "squeeze_":
        return _squeeze(spec, args[1] if len(args) > 1 else None, name)
    return None


def reshape_in_place(name: str, func: Any, args: Any, kwargs: Any) -> Any:
    target = args[0]
    spec = target._spec
    placements = new_placements(name, spec, args)
    if placements is None:
        raise NotImplementedError(f"{name} reallocates or restrides a DTensor in place; use the out-of-place "
                                  f"op on dt.full_tensor() or build a new DTensor")
    func(target._local_tensor, *args[1:], **kwargs)
    get_platform().apply_to_wrapper(func, target, args[1:], kwargs)  # the wrapper's own global shape
    shape = tuple(target.shape)
    target._spec = DTensorSpec(spec.mesh, normalize_placements(placements, len(shape), spec.mesh.ndim), shape)
    return target


__all__ = ["reshape_in_place"]
