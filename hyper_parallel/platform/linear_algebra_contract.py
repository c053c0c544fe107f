"""The linear algebra the chunked delta rule needs (core/context_parallel/linear_attention).

``Platform`` in base.py inherits it. The defaults are plain tensor algebra, the same on every
framework; a framework with a native kernel overrides them (torch: platform/torch/linear_algebra.py).
"""
from typing import Any, Callable


class LinearAlgebraContract:
    """Declared members of the chunked gated delta rule."""

    # Platform members (base.py) the defaults below use
    cat: Callable[..., Any]
    float32: Callable[[], Any]

    def solve_unit_lower(self, a: Any, b: Any) -> Any:
        """x with (I + strictly_lower(a)) x = b over the last two dims (a's diagonal and upper part
        unread)."""
        # forward substitution by rows: row i needs the rows before it only
        rows: list[Any] = []
        for i in range(a.shape[-2]):
            row = b[..., i:i + 1, :]
            if i:
                row = row - a[..., i:i + 1, :i] @ self.cat(rows, dim=-2)
            rows.append(row)
        return self.cat(rows, dim=-2)

    def compute_dtype(self, dtype: Any) -> Any:
        """The dtype the recurrent state is computed in: float32, or float64 for a float64 input."""
        # the state accumulates over the whole sequence, so it is never narrower than float32
        return dtype if str(dtype).lower().endswith("float64") else self.float32()
