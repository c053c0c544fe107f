"""The one place every MindSpore compiler passes a DTensor through: its conversion into a graph value.

A DTensor's own data is an empty placeholder (the shard is ``_local_tensor``); a compiled graph that
took it as an input or a constant computed on the placeholder and returned 0 on every rank, silently.
The compile entry points (compile_guard.py) inspect what they are given, but a DTensor reaches a graph
by many more paths (a default argument, a helper returning a global, an attribute of any object, a
container at any depth, a class attribute...). All of them end in MindSpore's object-to-graph
conversion (the ast parser, PIJit's bytecode capture and the argument converter alike), which asks
every object it converts whether it is a Parameter: ``hasattr(obj, "__parameter__")``. PyNative never
asks (an operator on a DTensor goes to ``__fallback__``). The DTensor class answers "no" as before, and
notes the sighting here; compile_guard.py compares the count before and after each compile and
refuses the graph (and its cached copy) when it moved.

Trace capture (``capture_mode="trace"``) does not convert objects: it runs the function in PyNative
and records the operators, so a DTensor's operators reach ``__fallback__`` while the trace is open.
:func:`check_not_tracing` closes the trace cleanly (a half-open trace broke every later operator and
aborted the process at exit) and raises the same error.

MindSpore's hasattr swallows exceptions, so the error cannot be raised from inside the conversion.
This module imports only MindSpore (the DTensor base and compile_guard.py both import it).
"""
from typing import Any, Optional

GRAPH_MODE_MESSAGE = ("hyper_parallel on MindSpore runs in PyNative mode only (its DTensor dispatch is "
                      "Python, which GRAPH_MODE and ms.jit compile away): call "
                      "ms.set_context(mode=ms.PYNATIVE_MODE) and do not wrap parallelized Cells in ms.jit")

_SEEN: dict[str, Any] = {"count": 0, "last": ""}
_TRACE = {"open": False}   # between a _jit_trace_begin that starts recording and its _jit_trace_end


class CompilerSighting:
    """The ``__parameter__`` attribute of the DTensor class: absent (AttributeError, so MindSpore's
    ``hasattr`` is False, as for any Tensor), but each look-up on an instance is counted."""

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        if obj is not None:
            _SEEN["count"] += 1
            _SEEN["last"] = _describe(obj)
        raise AttributeError("__parameter__")


def _describe(value: Any) -> str:
    """``value``: a DTensor, or the arguments of an operator (the first DTensor among them)."""
    if isinstance(value, (tuple, list)):
        value = next((v for v in value if hasattr(v, "_hp_shape")), None)
    shape = getattr(value, "_hp_shape", None)
    return f"a DTensor of shape {shape}" if shape is not None else "a DTensor"


def token() -> int:
    """The number of sightings so far (taken before a compile starts)."""
    return _SEEN["count"]


def sighted_since(before: int) -> Optional[str]:
    """What the compiler converted since ``token()`` returned ``before`` (None: no DTensor)."""
    return _SEEN["last"] if _SEEN["count"] != before else None


def refusal(who: str, what: str) -> str:
    """The documented error text: the entry point, what it found, and the fix (PYNATIVE_MODE)."""
    return (f"{who}: {what}; a compiled graph sees only the empty placeholder of a DTensor (a silent "
            f"wrong result). {GRAPH_MODE_MESSAGE}")


def trace_opened(new_compile: bool) -> None:
    """``_jit_trace_begin`` returned: when it starts recording (``new_compile``), the function runs next."""
    _TRACE["open"] = bool(new_compile)


def trace_closed() -> None:
    """``_jit_trace_end`` is called: the recording is over."""
    _TRACE["open"] = False


def tracing() -> bool:
    """Whether ``ms.jit(capture_mode="trace")`` is recording now."""
    return _TRACE["open"]


def check_not_tracing(dtensor: Any, what: Optional[str] = None) -> None:
    """Raise the documented error when an operator reaches a DTensor (``dtensor``: it, or the
    operator's arguments) while ``ms.jit(capture_mode="trace")`` records (a DTensor the argument check
    could not see), after closing the trace. ``what`` names anything else that refuses the same way
    (the platform's collectives)."""
    if not _TRACE["open"]:
        return
    _close_trace()
    raise RuntimeError(refusal("ms.jit(capture_mode='trace')",
                               f"{what or _describe(dtensor)} was reached while the trace recorded"))


def _close_trace() -> None:
    """End the open trace without running it (as ``_jit_trace_end`` does, which needs every caller's
    source line), and forget its phase so that the next call traces (and refuses) again instead of
    running a graph that was never completed."""
    import mindspore as ms
    from mindspore._c_expression import TraceRecorder
    from mindspore.graph import jit_trace
    context = jit_trace._trace_jit_context
    phase = context.phase
    try:
        TraceRecorder.get_instance().end_graph([__file__], [1], jit_trace._DEFAULT_JIT_CONFIG, ms.Tensor(0.0))
    finally:
        abandon_trace()
        jit_trace._trace_compile_cache.discard(phase)
        context.phase, context.args = "", None


def abandon_trace() -> None:
    """Leave MindSpore's trace state closed: after a failed ``_jit_trace_begin`` (it sets the trace
    context before steps that can raise) every later operator of the process was recorded into a trace
    that never ends, failed, and the process aborted at exit."""
    from mindspore.graph import jit_trace
    from mindspore.graph.jit_context import set_jit_context
    _TRACE["open"] = False
    set_jit_context(None)
    jit_trace._trace_jit_context.compiled = False
    jit_trace._using_trace = False
