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
``_JitExecutor.compile`` (ast), ``Cell.compile`` and the Cell graph executor (GRAPH_MODE, ms.export),
``_jit_trace_begin`` (trace) and ``PreJit`` (bytecode) -- call-time points that also catch functions
decorated before the platform existed. Every other path (a default argument, a global behind a
helper, an attribute of any object, a container at any depth...) is caught *after* compiling: the
DTensor class counts each time a compiler converts one (placeholder_guard.py), and a graph that
converted one is refused, also when MindSpore serves it from its cache later (``_REFUSED``; bytecode:
when PIJit's context exits, by the function's code object). Trace converts nothing: the DTensor's
first operator refuses while the trace records. A parse error raised inside hyper_parallel's code (a
parallelized Cell in a plain list attribute) is turned into the same error by ``_rephrased``.

``ms.vjp`` is checked here too (``_checked_vjp_forward``): it seeds backward with a cotangent of the
output's shape, and a non-scalar DTensor output's placeholder is empty, so MindSpore failed deep
inside with "The shape should be {0}, but got {4, 6}".
"""
from typing import Any
import functools
import os
import sys

import mindspore as ms

from hyper_parallel.platform.mindspore import placeholder_guard
from hyper_parallel.platform.mindspore.dtensor_base import MindSporeDTensorBase
from hyper_parallel.platform.mindspore.placeholder_guard import GRAPH_MODE_MESSAGE

BYTECODE = "ms.jit(capture_mode='bytecode')"

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
# attribute set on Cells whose calls hyper_parallel routes (hooks, replaced construct, DTensor params)
MARK = "_hp_parallelized"


def check_pynative(who: Any) -> None:
    """Raise the hyper_parallel error naming GRAPH_MODE and the fix when not in PyNative mode."""
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise RuntimeError(f"{who}: MindSpore is in GRAPH_MODE. {GRAPH_MODE_MESSAGE}")


def mark(cell: Any) -> None:
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


def refuse(who: Any, *values: Any, fn: Any = None) -> None:
    """Raise the documented RuntimeError when a compiler is about to see hyper_parallel objects."""
    why = _reason(values) or (_function_reason(fn) if fn is not None else None)
    if why:
        raise RuntimeError(placeholder_guard.refusal(who, why))


def _rephrased(compile_fn, who, inputs, graph_key):
    """``compile_fn`` (a MindSpore compile step) that first refuses hyper_parallel objects
    (``inputs(*args, **kwargs)`` -> (values, function)), then refuses the graph when the compiler
    converted a DTensor by any other path (placeholder_guard.py; ``graph_key(result, *args)`` names the
    cached graph, refused on every later call too), and turns parse errors raised inside
    hyper_parallel's code (MindSpore's message then lists our files) into the same error."""
    @functools.wraps(compile_fn)
    def compile_(*args, **kwargs):
        values, fn = inputs(*args, **kwargs)
        refuse(who, *values, fn=fn)
        before = placeholder_guard.token()
        try:
            result = compile_fn(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError) as exc:
            seen = placeholder_guard.sighted_since(before)
            if seen:
                raise RuntimeError(_sighted(who, seen)) from exc
            if isinstance(exc, ValueError) or (_PACKAGE_DIR not in str(exc) and not _parsing_ours(exc)):
                raise
            first = str(exc).strip().split("\n")[0]
            raise RuntimeError(f"MindSpore compiled hyper_parallel's code in GRAPH_MODE or under ms.jit "
                               f"({first}). {GRAPH_MODE_MESSAGE}") from exc
        _refuse_graph(who, graph_key(result, *args), placeholder_guard.sighted_since(before))
        return result
    compile_._hp_rephrased = True
    return compile_


def _parsing_ours(exc):
    """Whether MindSpore's ast parser raised while parsing a function of hyper_parallel (its Parser
    object, ``self`` of a frame of the traceback, names the file): e.g. a parallelized Cell kept in a
    plain list attribute, which the Cell check does not see, failed with "issubclass() arg 1 must be a
    class" on a ``with`` statement of our hooks."""
    tb = exc.__traceback__
    while tb is not None:
        filename = getattr(tb.tb_frame.f_locals.get("self"), "filename", None)
        if isinstance(filename, str) and filename.startswith(_PACKAGE_DIR):
            return True
        tb = tb.tb_next
    return False


# graphs (MindSpore's cache keys) compiled with a DTensor's placeholder in them: refused on every call,
# also when MindSpore reuses the cached graph without converting anything again
_REFUSED: dict[Any, Any] = {}


def _sighted(who, seen):
    return placeholder_guard.refusal(who, f"{seen} reached the compiled graph (through a default argument, "
                                          f"a global, an attribute or a container)")


def _refuse_graph(who, key, seen):
    if seen and key is not None:
        _REFUSED[key] = seen
    seen = seen or _REFUSED.get(key)
    if seen:
        raise RuntimeError(_sighted(who, seen))


def _ast_key(phase, executor, *args, **kwargs):
    return ("ast", phase)


def _cell_key(result, cell, *args, **kwargs):
    return ("cell", getattr(cell, "compile_phase", None))


def _executor_inputs(executor, cell, *args, **kwargs):
    return (cell, args, kwargs), None


def _executor_key(result, *args, **kwargs):
    # (phase, new) -- the Cell executor also compiles for ms.export and the train Model
    return ("cell", result[0]) if isinstance(result, tuple) and result else None


def _trace_key(new_compile, *args, **kwargs):
    # trace converts nothing: the function runs next, recording; DTensor operators then refuse
    # (placeholder_guard.check_not_tracing)
    placeholder_guard.trace_opened(new_compile)
    return None


def _trace_begin(begin):
    @functools.wraps(begin)
    def begin_(*args, **kwargs):
        try:
            return begin(*args, **kwargs)
        except BaseException:
            placeholder_guard.abandon_trace()
            raise
    return begin_


def _trace_end(end):
    @functools.wraps(end)
    def end_(*args, **kwargs):
        placeholder_guard.trace_closed()
        try:
            return end(*args, **kwargs)
        except BaseException:   # MindSpore left the trace open: every later operator would fail
            placeholder_guard.abandon_trace()
            raise
    end_._hp_rephrased = True
    return end_


def _bytecode_key(result, *args, **kwargs):
    # PreJit runs before PIJit captures anything: remember where the sightings count stood, for __exit__
    context = sys._getframe(2).f_locals.get("self")
    if context is None:
        return None
    context._hp_token = placeholder_guard.token()
    return ("bytecode", getattr(context.fn, "__code__", None))


def _bytecode_exit(exit_):
    """PIJit captures and runs the function inside its context; on leaving it, a DTensor converted on
    the way refuses the result and the function's code (PIJit caches the compiled code per code object
    and reuses it without converting again)."""
    @functools.wraps(exit_)
    def exit_checked(self, exc_type, exc_val, exc_tb):
        result = exit_(self, exc_type, exc_val, exc_tb)
        before = self.__dict__.pop("_hp_token", None)
        seen = placeholder_guard.sighted_since(before) if before is not None else None
        if seen and exc_type is not None:   # e.g. fullgraph=True: "Unsupported: Cannot infer ..."
            _REFUSED[("bytecode", getattr(self.fn, "__code__", None))] = seen
            raise RuntimeError(_sighted(BYTECODE, seen)) from exc_val
        if before is not None and exc_type is None:
            _refuse_graph(BYTECODE, ("bytecode", getattr(self.fn, "__code__", None)), seen)
        return result
    exit_checked._hp_rephrased = True
    return exit_checked


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


def install() -> None:
    """Once per process: every compile entry point refuses hyper_parallel objects (module docstring)."""
    from mindspore.graph import api, jit_trace
    from mindspore.graph._utils import pijit_context
    patches = ((api._JitExecutor, "compile", "ms.jit", _ast_inputs, _ast_key),
               (ms.nn.Cell, "compile", "a Cell compiled in GRAPH_MODE", _cell_inputs, _cell_key),
               (api._CellGraphExecutor, "compile", "a Cell compiled in GRAPH_MODE", _executor_inputs,
                _executor_key),
               (jit_trace, "_jit_trace_begin", "ms.jit(capture_mode='trace')", _trace_inputs, _trace_key),
               (pijit_context, "PreJit", BYTECODE, _bytecode_inputs, _bytecode_key))
    for owner, name, who, inputs, key in patches:
        original = getattr(owner, name)
        if not getattr(original, "_hp_rephrased", False):
            original = _trace_begin(original) if key is _trace_key else original
            setattr(owner, name, _rephrased(original, who, inputs, key))
    exit_ = pijit_context.PIJitCaptureContext.__exit__
    if not getattr(exit_, "_hp_rephrased", False):
        pijit_context.PIJitCaptureContext.__exit__ = _bytecode_exit(exit_)
    if not getattr(jit_trace._jit_trace_end, "_hp_rephrased", False):
        jit_trace._jit_trace_end = _trace_end(jit_trace._jit_trace_end)
    from mindspore.ops.function.grad import grad_func
    if not getattr(grad_func._pynative_func_grad_forward, "_hp_rephrased", False):
        grad_func._pynative_func_grad_forward = _checked_vjp_forward(grad_func._pynative_func_grad_forward)
