"""Checks of the numeric arguments of every public entry point (SPEC §19), in one place.

A NaN softcap, an infinite scale or ``chunks=True`` is accepted by arithmetic and surfaces much later
as NaN outputs or a tile of one token; each entry point calls one of these before anything moves,
so the error names the entry point, the argument, its value and the fix. ``bool`` is never taken
for an int (``True`` is 1 to Python, never what the caller meant); NaN and ±inf are never taken
for a float. Each check returns the value as a Python ``int`` / ``float``.
"""
from typing import Any
import math
import numbers

__all__ = ["check_int", "check_float", "check_optional_int", "check_optional_float"]


def _fail(who, name, value, problem, fix):
    advice = f"; pass {fix}" if fix else ""
    raise ValueError(f"{who}({name}={value!r}): {problem}{advice}")


def check_int(who: str, name: str, value: Any, *, minimum: Any = None, maximum: Any = None,
              fix: str = "") -> int:
    """``value`` as an int; ValueError naming ``who(name=value)`` unless it is an integer (not a bool)
    in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(who, name, value, f"must be an int, not {type(value).__name__}", fix)
    value = int(value)
    if minimum is not None and value < minimum:
        _fail(who, name, value, f"must be >= {minimum}", fix)
    if maximum is not None and value > maximum:
        _fail(who, name, value, f"must be <= {maximum}", fix)
    return value


def check_float(who: str, name: str, value: Any, *, positive: bool = False, minimum: Any = None,
                maximum: Any = None, fix: str = "") -> float:
    """``value`` as a finite float; ValueError naming ``who(name=value)`` unless it is a real number (not
    a bool), not NaN or ±inf, > 0 when ``positive``, and in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(who, name, value, f"must be a number, not {type(value).__name__}", fix)
    value = float(value)
    if not math.isfinite(value):
        _fail(who, name, value, "must be finite (not NaN or infinite)", fix)
    if positive and value <= 0:
        _fail(who, name, value, "must be > 0", fix)
    if minimum is not None and value < minimum:
        _fail(who, name, value, f"must be >= {minimum}", fix)
    if maximum is not None and value > maximum:
        _fail(who, name, value, f"must be <= {maximum}", fix)
    return value


def check_optional_int(who: str, name: str, value: Any, **limits: Any) -> Any:
    """None, or ``check_int``."""
    return None if value is None else check_int(who, name, value, **limits)


def check_optional_float(who: str, name: str, value: Any, **limits: Any) -> Any:
    """None, or ``check_float``."""
    return None if value is None else check_float(who, name, value, **limits)


# ------------------------------------------------------------------ entry points with several numbers
def check_delta_rule_numbers(chunk_size: Any, scale: Any) -> None:
    """The linear-attention delta rule's chunk size and scale (plain and under context parallelism)."""
    check_int("delta_rule", "chunk_size", chunk_size, minimum=1, fix="tokens per chunk of the rule (64)")
    check_optional_float("delta_rule", "scale", scale, fix="a finite scale, or None (1/sqrt(d_k))")
