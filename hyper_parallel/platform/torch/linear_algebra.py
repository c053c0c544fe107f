"""torch's kernels for the linear-algebra contract (platform/linear_algebra_contract.py)."""
from typing import Any
import torch


class TorchLinearAlgebra:
    @staticmethod
    def solve_unit_lower(a: Any, b: Any) -> Any:
        return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)

    @staticmethod
    def compute_dtype(dtype: Any) -> Any:
        return torch.promote_types(dtype, torch.float32)
