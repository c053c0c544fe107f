"""torch's kernels for the linear-algebra contract (platform/linear_algebra_contract.py)."""
import torch


class TorchLinearAlgebra:
    @staticmethod
    def solve_unit_lower(a, b):
        return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)

    @staticmethod
    def compute_dtype(dtype):
        return torch.promote_types(dtype, torch.float32)
