"""Every MindSpore compiler entry point refuses DTensors and parallelized Cells with one error.

hyper_parallel's DTensor dispatch is Python (``__fallback__``, Cell hooks, collectives); a compiler
sees only a DTensor's empty placeholder. Left alone, each entry point failed its own way:

* ``ms.jit`` (capture_mode "ast") and GRAPH_MODE Cells compiled ``(d * 2).sum()`` on the placeholder
  and returned a plain 0.0 or uninitialised memory -- a silent wrong result; a parallelized Cell
  made the parser fail inside our hooks, or in a closure ("Parse Resolve convert failed ... create an
  issue at gitee");
* ``capture_mode="trace"`` records ops while running: a failure inside leaves MindSpore's trace state
  half-open (every later op fails, the process aborts at exit);
* ``capture_mode="bytecode"`` compiled the ops it could and gave the same wrong values as "ast".

So the arguments, the Cell and the function's closure are inspected *before* MindSpore starts:
``_JitExecutor.compile`` (ast), ``Cell.compile`` (GRAPH_MODE), ``_jit_trace_begin`` (trace) and
``PreJit`` (bytecode) -- call-time points that also catch functions decorated before the platform
existed. What is still only found while parsing (a parallelized Cell reached through attributes) is
turned into the same error by ``_rephrased``.

``ms.vjp`` is checked here too (``_checked_vjp_forward``): it seeds backward with a cotangent of the
output's shape, and a non-scalar DTensor output's placeholder is empty, so MindSpore failed deep
inside with "The shape should be {0}, but got {4, 6}".
"""
import functools
import os
import sys

import mindspore as ms

from hyper_parallel.platform.mindspore.dtensor_base import MindSporeDTensorBase

GRAPH_MODE_MESSAGE = ("hyper_parallel on MindSpore runs in PyNative mode only (its DTensor dispatch is "
                      "Python, which GRAPH_MODE and ms.jit compile away): call "
                      "ms.set_context(mode=ms.PYNATIVE_MODE) and do not wrap parallelized Cells in ms.jit")

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
# attribute set on Cells whose calls hyper_parallel routes (hooks, replaced construct, DTensor params)
MARK = "_hp_parallelized"


def check_pynative(who):
    """Raise the hyper_parallel error naming GRAPH_MODE and the fix when not in PyNative mode."""
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise RuntimeError(f"{who}: MindSpore is in GRAPH_MODE. {GRAPH_MODE_MESSAGE}")


def mark(cell):
    """Remember that ``cell``'s calls go through hyper_parallel (the compile checks look for it)."""
    object.__setattr__(cell, MARK, True)


def _cell_reason(cell):
    for name, sub in cell.cells_and_names():
        attrs = sub.__dict__
        if attrs.get(MARK):
            return f"Cell {name or type(cell).__name__} is parallelized by hyper_parallel"
        for attr, value in attrs.items():
            if isinstance(value, MindSporeDTensorBase):
                return f"attribute {(name + '.') if name else ''}{attr} of {type(sub).__name__} is a DTensor"
    return None


def _reason(value, depth=0):
    """Why ``value`` cannot be compiled (a DTensor, a parallelized Cell, inside containers), or None."""
    if isinstance(value, MindSporeDTensorBase):
        return f"a DTensor of shape {tuple(value.shape)}"
    if isinstance(value, ms.nn.Cell):
        return _cell_reason(value)
    if depth < 3 and isinstance(value, (list, tuple)):
        return next((r for r in (_reason(v, depth + 1) for v in value) if r), None)
    if depth < 3 and isinstance(value, dict):
        return _reason(list(value.values()), depth + 1)
    return None


def _function_reason(fn):
    """DTensors or parallelized Cells a function reaches through its closure or its globals."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    values = [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]
    glob = getattr(fn, "__globals__", {})
    values += [glob[n] for n in code.co_names if n in glob]
    return _reason(values)


def _filled(cell):
    try:
        cell.cell_contents
    except ValueError:   # a closure variable not assigned yet
        return False
    return True


def refuse(who, *values, fn=None):
    """Raise the documented RuntimeError when a compiler is about to see hyper_parallel objects."""
    why = _reason(values) or (_function_reason(fn) if fn is not None else None)
    if why:
        raise RuntimeError(f"{who}: {why}; a compiled graph sees only the empty placeholder of a "
                           f"DTensor (a silent wrong result). {GRAPH_MODE_MESSAGE}")


def _rephrased(compile_fn, who, inputs):
    """``compile_fn`` (a MindSpore compile step) that first refuses hyper_parallel objects
    (``inputs(*args, **kwargs)`` -> (values, function)), and turns parse errors raised inside
    hyper_parallel's code (MindSpore's message then lists our files) into the same error."""
    @functools.wraps(compile_fn)
    def compile_(*args, **kwargs):
        values, fn = inputs(*args, **kwargs)
        refuse(who, *values, fn=fn)
        try:
            return compile_fn(*args, **kwargs)
        except (RuntimeError, TypeError) as exc:
            if _PACKAGE_DIR not in str(exc):
                raise
            first = str(exc).strip().split("\n")[0]
            raise RuntimeError(f"MindSpore compiled hyper_parallel's code in GRAPH_MODE or under ms.jit "
                               f"({first}). {GRAPH_MODE_MESSAGE}") from exc
    compile_._hp_rephrased = True
    return compile_


def _ast_inputs(executor, method_name, *args, **kwargs):
    return (executor.obj, args, kwargs), executor.fn


def _cell_inputs(cell, *args, **kwargs):
    return (cell, args, kwargs), None


def _trace_inputs(fn_name, *args, **kwargs):
    # jit_trace_wrap passes the arguments without the Cell; its frame holds all of them
    caller = sys._getframe(2).f_locals
    return (args, caller.get("args"), caller.get("obj")), caller.get("fn")


def _bytecode_inputs(args, kwargs):
    # PIJitCaptureContext's wrapper calls PreJit; its frame holds the context, whose fn is the function
    context = sys._getframe(2).f_locals.get("self")
    return (args, kwargs), getattr(context, "fn", None)


def _checked_vjp_forward(forward):
    """``ms.vjp``'s forward run, refusing an output MindSpore's vjp cannot seed (module docstring)."""
    @functools.wraps(forward)
    def run(fn, *args, **kwargs):
        out = forward(fn, *args, **kwargs)
        for value in (out if isinstance(out, tuple) else (out,)):
            if isinstance(value, MindSporeDTensorBase) and value.numel() != 1:
                raise ValueError(
                    f"ms.vjp: the function returned a DTensor of shape {tuple(value.shape)} "
                    f"(placements {tuple(value.placements)}); MindSpore seeds backward on the tensor "
                    f"object, whose data is a placeholder. Return out.full_tensor() (cotangent of the "
                    f"global shape, gradients equal one process) or out.to_local() (cotangent: this "
                    f"rank's piece), or reduce it to a scalar DTensor")
        return out
    run._hp_rephrased = True
    return run


def install():
    """Once per process: every compile entry point refuses hyper_parallel objects (module docstring)."""
    from mindspore.graph import api, jit_trace
    from mindspore.graph._utils import pijit_context
    patches = ((api._JitExecutor, "compile", "ms.jit", _ast_inputs),
               (ms.nn.Cell, "compile", "a Cell compiled in GRAPH_MODE", _cell_inputs),
               (jit_trace, "_jit_trace_begin", "ms.jit(capture_mode='trace')", _trace_inputs),
               (pijit_context, "PreJit", "ms.jit(capture_mode='bytecode')", _bytecode_inputs))
    for owner, name, who, inputs in patches:
        original = getattr(owner, name)
        if not getattr(original, "_hp_rephrased", False):
            setattr(owner, name, _rephrased(original, who, inputs))
    from mindspore.ops.function.grad import grad_func
    if not getattr(grad_func._pynative_func_grad_forward, "_hp_rephrased", False):
        grad_func._pynative_func_grad_forward = _checked_vjp_forward(grad_func._pynative_func_grad_forward)
