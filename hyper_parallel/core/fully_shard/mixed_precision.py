"""MixedPrecisionPolicy: the dtypes of gathered parameters, of gradient reduction and of outputs."""
from typing import Optional, Tuple
from dataclasses import dataclass

from hyper_parallel.core.typing import DType
from hyper_parallel.platform import get_platform


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: gathered parameters (and so forward/backward compute) in this dtype; the
    sharded master parameters keep theirs. ``reduce_dtype``: gradients are reduce-scattered in it
    (default: ``param_dtype``, as PyTorch's FSDP2). ``output_dtype``: floating outputs of the
    module cast to it. ``cast_forward_inputs``: floating inputs cast to ``param_dtype``."""
    param_dtype: object = None
    reduce_dtype: object = None
    output_dtype: object = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        platform = get_platform()
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not _is_floating(platform, dtype):
                raise ValueError(f"MixedPrecisionPolicy({field}={dtype!r}): a floating dtype or None is "
                                 f"required (e.g. torch.bfloat16 / torch.float32)")


def _is_floating(platform, dtype):
    try:
        return bool(platform.is_floating_dtype(dtype))
    except (AttributeError, TypeError):
        return False


def check_policy(mp_policy: Optional["MixedPrecisionPolicy"]) -> "MixedPrecisionPolicy":
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"fully_shard(mp_policy={mp_policy!r}): pass a hyper_parallel.MixedPrecisionPolicy "
                         f"or None")
    return mp_policy or MixedPrecisionPolicy()


def compute_dtypes(policy: "MixedPrecisionPolicy", orig_dtype: DType) -> Tuple[DType, DType]:
    """(gathered parameter dtype, gradient reduction dtype) of a parameter of ``orig_dtype``."""
    param_dtype = policy.param_dtype or orig_dtype
    return param_dtype, policy.reduce_dtype or param_dtype
