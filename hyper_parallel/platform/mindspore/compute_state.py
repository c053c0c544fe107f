"""MindSpore's element sizes (platform/compute_state_contract.py). Its computation state is the
contract's default: MindSpore records gradients inside ms.grad / value_and_grad, which the caller
chooses per call, and applies mixed precision per Cell, so there is no global mode to leave."""
from typing import Any
import functools

import mindspore as ms


class MindSporeComputeState:
    @staticmethod
    @functools.lru_cache(maxsize=None)
    def dtype_itemsize(dtype: Any) -> int:
        return int(ms.Tensor(0, dtype).itemsize)
