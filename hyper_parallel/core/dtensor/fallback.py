"""Ops without a sharding rule: replicate, run, return Replicate — and say so, once per op."""
import contextlib
import os
import warnings

_warned = set()
_recorders = []


@contextlib.contextmanager
def recording_fallbacks():
    """Collect the names of the ops that take the fallback inside the block (the op sweep's table
    and tests use it to tell a rule from a fallback)."""
    names = set()
    _recorders.append(names)
    try:
        yield names
    finally:
        _recorders.remove(names)


def strict_dispatch():
    return os.environ.get("HP_STRICT_DISPATCH", "").strip().lower() in ("1", "true", "yes", "on")


def report_missing_rule(op_name):
    for names in _recorders:
        names.add(op_name)
    if strict_dispatch():
        raise NotImplementedError(
            f"hyper_parallel has no sharding rule for {op_name} on DTensor inputs (HP_STRICT_DISPATCH=1). "
            f"Add one with hyper_parallel.core.dtensor.ops.register_rule, or unset HP_STRICT_DISPATCH to "
            f"run it replicated.")
    if op_name not in _warned:
        _warned.add(op_name)
        warnings.warn(f"hyper_parallel: no sharding rule for {op_name}; its DTensor inputs are "
                      f"replicated (all-gathered) and it runs on full tensors. Register a rule to "
                      f"avoid the extra communication.", stacklevel=3)
