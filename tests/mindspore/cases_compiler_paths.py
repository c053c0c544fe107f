"""Every path by which a DTensor reaches a MindSpore compiled graph (tests/test_mindspore_compiler_paths.py):
a generated table of paths (arguments, defaults, globals, closures, attributes, containers, classes,
Cells) x compilers (ms.jit ast / bytecode / trace, GRAPH_MODE) x DTensor kinds (a TP parameter's view,
an activation). Each compiled call either equals the same graph on a plain tensor of the full value
(numpy's reference) or raises the GRAPH_MODE error -- on the first call and on the cached second one.
Never a value computed on the empty placeholder.

Imported by MindSpore workers only (no torch, no pytest); results are plain Python values.
"""
import dataclasses
import functools

import numpy as np

from tests.frameworks import inp, np_of

ROWS, COLS = 4, 6
FUNCTION_MODES = ("ast", "bytecode", "trace")
CELL_MODES = ("ast", "bytecode", "trace", "graph")
G_T = None   # the module global some compiled functions read (set before each case)
CELL_PATHS = ("list attribute", "dict attribute", "module global", "class attribute", "CellList child",
              "SequentialCell", "plain dict of Cells")
KINDS = ("plain", "parameter", "activation")


def _times(x, t):
    return (x * t).sum()


def _helper():
    return G_T


class _Obj:
    pass


@dataclasses.dataclass
class _Record:
    t: object


class _Plain:
    """``@ms.jit`` on a method of a plain (non-Cell) class."""

    def __init__(self, t):
        self.t = t

    def run(self, x):
        return (x * self.t).sum()


def grad_and_fullgraph(rank, world_size):
    """ms.grad around / inside ms.jit, GRAPH_MODE grad and value_and_grad of a Cell, bytecode with
    fullgraph=True, a DTensor read from a module global or a list attribute: {case: outcome}."""
    import mindspore as ms
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    w, x = inp("paths_w", 0, (ROWS, COLS)), ms.Tensor(inp("paths_x", 0, (ROWS, COLS)))
    want = np.float64((x.asnumpy().astype(np.float64) * w).sum())
    out = {}
    for kind, t in [("plain", ms.Tensor(w))] + list(_kinds(ms, mesh, w).items()):
        cell, (reads_global, _) = cell_paths(t)["list attribute"], function_paths(t)["module_global"]
        graph = functools.partial(_compiled, ms, mode="graph")
        calls = {"grad(jit(f))": (lambda: ms.grad(ms.jit(reads_global))(x), w),
                 "jit(grad(f))": (lambda: ms.jit(ms.grad(reads_global))(x), w),
                 "GRAPH_MODE grad(cell)": (lambda: graph(ms.grad(cell))(x), w),
                 "GRAPH_MODE value_and_grad(cell)": (lambda: graph(ms.value_and_grad(cell))(x)[0], want),
                 "bytecode fullgraph": (lambda: ms.jit(reads_global, capture_mode="bytecode",
                                                       fullgraph=True)(x), want)}
        for name, (call, expected) in calls.items():
            out[f"{kind} | {name}"] = [_outcome(call, expected) for _ in "12"]
    return out


def function_paths(t):
    """name -> (function, extra call arguments): each reads ``t`` by one path and returns sum(x * t)."""
    global G_T
    G_T = t
    box, tree, holder, record = [[[[t]]]], {"a": {"b": (t,)}}, _Obj(), _Record(t)
    holder.t = t
    part = functools.partial(_times, t=t)
    klass = type("Klass", (), {"t": t})

    def inner():
        return t

    def argument(x, t):
        return (x * t).sum()

    def default(x, t=t):
        return (x * t).sum()

    def kw_default(x, *, t=t):
        return (x * t).sum()

    def closure(x):
        return (x * t).sum()

    def nonlocal_helper(x):
        return (x * inner()).sum()

    def module_global(x):
        return (x * G_T).sum()

    def global_helper(x):
        return (x * _helper()).sum()

    def attribute(x):
        return (x * holder.t).sum()

    def nested_4_deep(x):
        return (x * box[0][0][0][0]).sum()

    def dict_of_tuple(x):
        return (x * tree["a"]["b"][0]).sum()

    def dataclass_field(x):
        return (x * record.t).sum()

    def partial_argument(x):
        return part(x)

    def class_attribute(x):
        return (x * klass.t).sum()
    paths = {f.__name__: (f, ()) for f in (default, kw_default, closure, nonlocal_helper, module_global,
                                           global_helper, attribute, nested_4_deep, dict_of_tuple,
                                           dataclass_field, partial_argument, class_attribute)}
    paths["argument"] = (argument, (t,))
    paths["plain class method"] = (_Plain(t).run, ())   # not under trace: it takes any object for a Cell
    return paths


def cell_paths(t):
    """name -> Cell whose construct(x) returns sum(x * t), reading ``t`` by one path."""
    import mindspore as ms
    global G_T
    G_T = t

    class InList(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.held = [t]

        def construct(self, x):
            return (x * self.held[0]).sum()

    class InDict(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.held = {"t": t}

        def construct(self, x):
            return (x * self.held["t"]).sum()

    class ReadsGlobal(ms.nn.Cell):
        def construct(self, x):
            return (x * G_T).sum()

    class Scale(ms.nn.Cell):   # a child that returns x * t, t in a list attribute
        def __init__(self):
            super().__init__()
            self.held = [t]

        def construct(self, x):
            return x * self.held[0]

    class Outer(ms.nn.Cell):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def construct(self, x):
            return self.inner(x).sum()

    class InPlainDict(ms.nn.Cell):   # Cells in a plain dict attribute
        def __init__(self):
            super().__init__()
            self.blocks = {"a": Scale()}

        def construct(self, x):
            return self.blocks["a"](x).sum()

    class ClassAttr(ms.nn.Cell):
        T = t

        def construct(self, x):
            return (x * self.T).sum()
    cells = (InList(), InDict(), ReadsGlobal(), ClassAttr(), Outer(ms.nn.CellList([Scale()])[0]),
             Outer(ms.nn.SequentialCell([Scale()])), InPlainDict())
    return dict(zip(CELL_PATHS, cells))


def _compiled(ms, target, mode):
    """A call running ``target`` compiled in ``mode`` (GRAPH_MODE: a Cell called in that mode)."""
    if mode == "trace":
        return _in_thread(ms.jit(target, capture_mode=mode))
    if mode != "graph":
        return ms.jit(target, capture_mode=mode)

    def in_graph_mode(*args):
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            return target(*args)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    return in_graph_mode


def _outcome(call, want):
    """'right', 'refused' (the GRAPH_MODE error), or what went wrong (MindSpore may raise only when the
    value is read: the read is part of the call)."""
    from mindspore.graph.jit_context import jit_context
    if jit_context() is not None:
        return "trace left open before"
    try:
        value = np.asarray(np_of(call()), np.float64)
    except (RuntimeError, ValueError) as exc:
        text = str(exc)
        if "PYNATIVE_MODE" in text and "GRAPH_MODE" in text:
            return "refused"
        return f"{type(exc).__name__}: {text.strip().splitlines()[0][:160]}"
    except Exception as exc:   # noqa: BLE001 -- every other failure is reported by name
        return f"{type(exc).__name__}: {str(exc).strip()[:160]}"
    if jit_context() is not None:   # a trace left open: every later operator of the process fails
        return "trace left open"
    if value.shape != np.shape(want) or not np.allclose(value, want, rtol=1e-5, atol=1e-5):
        return f"WRONG {value.tolist()} (expected {float(want)})"
    return "right"


def _in_thread(call):
    """``call`` run on a thread of its own: MindSpore's trace reads the source line of every frame on
    the stack and fails ("'NoneType' object is not subscriptable") under ``python -m`` (the worker's
    runpy frames have none); a thread's stack starts in threading.py."""
    import threading

    def run(*args):
        box = {}

        def body():
            try:
                box["value"] = call(*args)
            except BaseException as exc:   # noqa: BLE001 -- re-raised on the caller's thread
                box["error"] = exc
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]
    return run


def _kinds(ms, mesh, w):
    """A TP parameter's DTensor view (Colwise Linear weight) and an activation, both of value ``w``."""
    from mindspore import mint
    from hyper_parallel import ColwiseParallel, Shard, distribute_tensor, parallelize_module

    class Lin(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.lin = mint.nn.Linear(COLS, ROWS, bias=False)

        def construct(self, x):
            return self.lin(x)
    net = Lin()
    net.lin.weight.set_data(ms.Tensor(w))
    net = parallelize_module(net, mesh, {"lin": ColwiseParallel()})
    return {"parameter": net.lin.weight, "activation": distribute_tensor(ms.Tensor(w), mesh, [Shard(1)])}


def _tp_in_list(ms, mesh, w, x):
    """A TP Cell kept in a plain list attribute (MindSpore failed with an issubclass() TypeError), and
    ``DTensor.from_local`` inside a compiled function (the error named ms.shard): (name, call, want)."""
    from hyper_parallel import DTensor, Shard
    from tests.mindspore.cases_training import _mlp, _tp

    class Holder(ms.nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.blocks = [net]

        def construct(self, a):
            return self.blocks[0](a).sum()

    xt = ms.Tensor(inp("paths_xt", 0, (2, 4)))
    from mindspore.graph.jit_context import jit_context
    if jit_context() is not None:
        return [("trace left open", lambda: 0, 1)]
    want_tp = np.float64(_mlp()[0](xt).asnumpy().astype(np.float64).sum())
    world = mesh.size()

    def from_local(a):
        return DTensor.from_local(a, mesh, [Shard(0)]).sum()
    want_local = np.float64(world * x.asnumpy().astype(np.float64).sum())
    out = []
    for mode in CELL_MODES:
        out.append((f"{mode} | TP Cell in a list attribute",
                    functools.partial(_compiled(ms, Holder(_tp(_mlp()[0], mesh)), mode), xt), want_tp))
        if mode != "graph":
            out.append((f"{mode} | from_local inside", functools.partial(_compiled(ms, from_local, mode), x),
                        want_local))
    return out


def _skipped(mode, kind, name):
    # MindSpore's trace takes a plain class's object for a Cell (reads obj.create_time), and fails on a
    # Cell of plain tensors after other traces of the process ("Illegal AnfNode", then its recorder
    # stays open): both fail on plain tensors too
    return mode == "trace" and (name == "plain class method" or (kind == "plain" and name.startswith("Cell")))


def expected_cases(function_modes=FUNCTION_MODES, cell_modes=CELL_MODES):
    """The rows ``paths_table`` must return (pure Python: pytest checks nothing was lost)."""
    names = {m: (list(function_paths(None)) if m in function_modes else [])
             + ([f"Cell {n}" for n in CELL_PATHS] if m in cell_modes else [])
             for m in set(function_modes) | set(cell_modes)}
    rows = [f"{kind} | {mode} | {name}" for mode, ns in names.items() for kind in KINDS for name in ns
            if not _skipped(mode, kind, name)]
    extra = [f"{mode} | TP Cell in a list attribute" for mode in CELL_MODES]
    extra += [f"{kind} | ms.export | Cell list attribute" for kind in KINDS]
    return rows + extra + [f"{mode} | from_local inside" for mode in CELL_MODES if mode != "graph"]


def paths_table(rank, world_size, function_modes=FUNCTION_MODES, cell_modes=CELL_MODES):
    """Every path x mode x kind: {case: outcome of the first call / the second call}; the same paths on
    a plain tensor of the full value must give numpy's value (else the table is not testing anything).
    Trace runs first: MindSpore's trace of a Cell fails on plain tensors too ("Illegal AnfNode") once
    the same process compiled other functions or Cells."""
    import mindspore as ms
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    w, x = inp("paths_w", 0, (ROWS, COLS)), ms.Tensor(inp("paths_x", 0, (ROWS, COLS)))
    want = np.float64((x.asnumpy().astype(np.float64) * w).sum())
    kinds = [("plain", ms.Tensor(w))] + list(_kinds(ms, mesh, w).items())
    table, alive = {}, []   # alive: MindSpore's trace cache keys on id(); a freed id reused -> wrong graph
    for mode in sorted(set(function_modes) | set(cell_modes), key=lambda m: m != "trace"):
        for kind, t in kinds:
            targets = dict(function_paths(t)) if mode in function_modes else {}
            if mode in cell_modes:
                targets.update({f"Cell {name}": (cell, ()) for name, cell in cell_paths(t).items()})
            for name, (target, extra) in targets.items():
                if _skipped(mode, kind, name):
                    continue
                call = functools.partial(_compiled(ms, target, mode), x, *extra)
                alive.append((target, call))
                table[f"{kind} | {mode} | {name}"] = [_outcome(call, want) for _ in "12"]
    for name, call, expected in _tp_in_list(ms, mesh, w, x):
        table[name] = [_outcome(call, expected) for _ in "12"]
    for kind, t in kinds:
        cell = cell_paths(t)["list attribute"]
        table[f"{kind} | ms.export | Cell list attribute"] = [_exported(ms, cell, x) for _ in "12"]
    return table


def _exported(ms, cell, x):
    """``ms.export`` compiles the Cell too (MindIR holding the placeholder): 'exported' or 'refused'."""
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        try:
            ms.export(cell, x, file_name=f"{folder}/net", file_format="MINDIR")
        except RuntimeError as exc:
            return "refused" if "PYNATIVE_MODE" in str(exc) else f"RuntimeError: {str(exc)[:160]}"
    return "exported"
