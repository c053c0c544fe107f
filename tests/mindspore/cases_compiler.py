"""MindSpore compiler edges against one process (tests/test_mindspore_compiler.py): a plain Tensor or
Parameter on the left of a Python operator with a DTensor on the right, every jit entry point
(ast, bytecode, trace, GRAPH_MODE) given DTensors or parallelized Cells, ms.vjp of DTensor outputs.

Imported by MindSpore workers only (no torch, no pytest); results are plain Python values.
"""
import numpy as np

from tests.frameworks import close, expect_error, inp

# operator -> numpy reference; the float ones are also differentiated
FLOAT_OPS = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide, "**": np.power,
             "%": lambda a, b: np.mod(a, b)}
INT_OPS = {"&": np.bitwise_and, "|": np.bitwise_or, "^": np.bitwise_xor}
ROWS, COLS = 4, 6


def _apply(symbol, a, b):
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
            "**": lambda: a ** b, "%": lambda: a % b, "&": lambda: a & b, "|": lambda: a | b,
            "^": lambda: a ^ b, "@": lambda: a @ b, "//": lambda: a // b, "<": lambda: a < b,
            ">=": lambda: a >= b, "==": lambda: a == b}[symbol]()


def _inputs():
    # positive bases and divisors keep ** and / finite; one process sees the same arrays
    x = np.abs(inp("refl_x", 0, (ROWS, COLS))) + 0.5
    y = np.abs(inp("refl_y", 0, (ROWS, COLS))) + 0.5
    return x, y


def _placements():
    from hyper_parallel import Replicate, Shard
    return {"S(0)": [Shard(0)], "S(1)": [Shard(1)], "R": [Replicate()]}


def tensor_left_operators(rank, world_size):
    """``x OP d`` for a plain Tensor and a Parameter x: values and gradients equal one process."""
    import mindspore as ms
    from hyper_parallel import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    x, y = _inputs()
    checked = []
    for pname, placements in _placements().items():
        d = distribute_tensor(ms.Tensor(y), mesh, placements)
        for left in ("Tensor", "Parameter"):
            xt = ms.Tensor(x) if left == "Tensor" else ms.Parameter(ms.Tensor(x), name="w")
            for symbol in FLOAT_OPS:
                want = _apply(symbol, ms.Tensor(x), ms.Tensor(y)).asnumpy()
                close(_apply(symbol, xt, d), want, f"{left} {symbol} DTensor {pname}")
                checked.append(f"{left}{symbol}{pname}")
            xi, yi = (np.arange(ROWS * COLS).reshape(ROWS, COLS) * k % 7 for k in (3, 5))
            di = distribute_tensor(ms.Tensor(yi.astype(np.int32)), mesh, placements)
            for symbol, ref in INT_OPS.items():
                close(_apply(symbol, ms.Tensor(xi.astype(np.int32)), di), ref(xi, yi).astype(np.int32),
                      f"int Tensor {symbol} DTensor {pname}")
        # operators that already found the DTensor stay right
        for symbol in ("@", "//", "<", ">=", "=="):
            b = ms.Tensor(y.T) if symbol == "@" else ms.Tensor(y)
            db = distribute_tensor(b, mesh, placements)
            close(_apply(symbol, ms.Tensor(x), db), _apply(symbol, ms.Tensor(x), b).asnumpy(),
                  f"Tensor {symbol} DTensor {pname}")
    _functional_and_inplace(mesh, x, y)
    return len(checked)


def _functional_and_inplace(mesh, x, y):
    import mindspore as ms
    from mindspore import ops
    from hyper_parallel import Shard, distribute_tensor
    d = distribute_tensor(ms.Tensor(y), mesh, [Shard(0)])
    # MindSpore functions written with Python operators (input - floordiv(...) * other)
    for name in ("remainder", "fmod"):
        fn = getattr(ops, name)
        close(fn(ms.Tensor(x), d), fn(ms.Tensor(x), ms.Tensor(y)).asnumpy(), f"ops.{name}(Tensor, DTensor)")
    for symbol in ("+=", "-=", "*=", "/="):
        def inplace():
            xt = ms.Tensor(x)
            exec(f"xt {symbol} d", {}, {"xt": xt, "d": d})   # noqa: S102 -- every augmented operator
        expect_error(NotImplementedError, inplace, symbol, "x = x")
    expect_error(NotImplementedError, lambda: d.__iadd__(ms.Tensor(x)), "in-place")


def tensor_left_gradients(rank, world_size):
    """d/dx and d/dy of sum(x OP y) with x plain and y a DTensor from this rank's piece: one process's."""
    import mindspore as ms
    from hyper_parallel import DTensor, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    x, y = _inputs()
    piece = np.split(y, world_size, 0)[rank]
    for symbol in FLOAT_OPS:
        def dist(a, local):
            return _apply(symbol, a, DTensor.from_local(local, mesh, [Shard(0)])).sum()

        def single(a, b):
            return _apply(symbol, a, b).sum()
        gx, gy = ms.grad(dist, grad_position=(0, 1))(ms.Tensor(x), ms.Tensor(piece))
        rx, ry = ms.grad(single, grad_position=(0, 1))(ms.Tensor(x), ms.Tensor(y))
        close(gx, rx.asnumpy(), f"d x of x {symbol} d")
        close(gy, np.split(ry.asnumpy(), world_size, 0)[rank], f"d d of x {symbol} d")
    return True


def residual_block(rank, world_size):
    """``x + mlp(x)`` with a TP MLP whose output stays a DTensor: forward and gradients."""
    import mindspore as ms
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    from tests.mindspore.cases_training import E, _mlp
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    ref, arrays = _mlp()
    net = parallelize_module(_mlp(arrays)[0], mesh, {"w1": ColwiseParallel(),
                                                     "w2": RowwiseParallel(use_local_output=False)})
    x = ms.Tensor(inp("resid", 0, (2, E)))
    out = x + net(x)
    close(out, (x + ref(x)).asnumpy(), "x + sublayer(x)")
    g = ms.grad(lambda a: (a + net(a)).sum(), grad_position=0)(x)
    g_ref = ms.grad(lambda a: (a + ref(a)).sum(), grad_position=0)(x)
    close(g, g_ref.asnumpy(), "d x of x + sublayer(x)")
    return True


# ============================================================================ compilers
def _compiled_callables(ms, d, tp_net, attn, holder):
    """(what, call) for every jit entry point given hyper_parallel objects."""
    def doubled_sum(a):
        return (a * 2).sum()

    def first_doubled(t):
        return (t[0] * 2).sum()

    def closure(a):
        return a * d

    def cp_call(q, k, v):
        return attn(q, k, v)
    x = ms.Tensor(np.ones((4, 6), np.float32))
    xt = ms.Tensor(np.ones((2, 4), np.float32))
    q = ms.Tensor(inp("jitq", 0, (1, 4, 2, 8)))
    calls = []
    for mode in ("ast", "bytecode", "trace"):
        def jit(fn, mode=mode):
            return ms.jit(fn, capture_mode=mode)
        calls += [(f"{mode}: DTensor argument", lambda jit=jit: jit(doubled_sum)(d)),
                  (f"{mode}: DTensor in a tuple", lambda jit=jit: jit(first_doubled)((d,))),
                  (f"{mode}: DTensor in the closure", lambda jit=jit: jit(closure)(x)),
                  (f"{mode}: TP Cell", lambda jit=jit: jit(tp_net)(xt)),
                  (f"{mode}: ContextParallel Cell", lambda jit=jit: jit(attn)(q, q, q)),
                  (f"{mode}: ContextParallel in a function", lambda jit=jit: jit(cp_call)(q, q, q)),
                  (f"{mode}: Cell holding a DTensor", lambda jit=jit: jit(holder)(x))]
    return calls


def jit_entry_points(rank, world_size):
    """Each entry point raises the documented RuntimeError before compiling (none returns a value
    computed on a placeholder); eager use afterwards still equals one process."""
    import mindspore as ms
    from hyper_parallel import ContextParallel, Shard, distribute_tensor, init_device_mesh
    from tests.frameworks import current
    from tests.mindspore.cases_training import _mlp, _tp
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    y = inp("jity", 0, (4, 6))
    d = distribute_tensor(ms.Tensor(y), mesh, [Shard(0)])
    tp_net, ref = _tp(_mlp()[0], mesh), _mlp()[0]
    attn = ContextParallel(seq_dim=1, head_dim=2).apply(current().attention(), mesh)

    class Holder(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.t = d

        def construct(self, a):
            return a + self.t

    class Plain(ms.nn.Cell):
        def construct(self, a):
            return (a * 2).sum()
    holder, q = Holder(), ms.Tensor(inp("jitq", 0, (1, 4, 2, 8)))
    names = []
    for what, call in _compiled_callables(ms, d, tp_net, attn, holder):
        expect_error(RuntimeError, call, "PYNATIVE_MODE", "ms.jit")
        names.append(what)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        for what, call in (("GRAPH_MODE: DTensor argument", lambda: Plain()(d)),
                           ("GRAPH_MODE: ContextParallel Cell", lambda: attn(q, q, q)),
                           ("GRAPH_MODE: TP Cell", lambda: tp_net(ms.Tensor(np.ones((2, 4), np.float32)))),
                           ("GRAPH_MODE: Cell holding a DTensor", lambda: Holder()(ms.Tensor(y)))):
            expect_error(RuntimeError, call, "GRAPH_MODE", "PYNATIVE_MODE")
            names.append(what)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    close((d * 2).sum(), np.float32((y * 2).sum()), "eager (d * 2).sum() after the refusals")
    xt = ms.Tensor(inp("jitx", 0, (2, 4)))
    close(tp_net(xt), ref(xt).asnumpy(), "eager TP forward after the refusals")

    def plain(a):
        return (a * 2).sum()
    for mode in ("ast", "bytecode"):   # plain tensors still compile (trace needs source lines)
        close(ms.jit(plain, capture_mode=mode)(ms.Tensor(y)), np.float32((y * 2).sum()), f"{mode} plain")
    return names


def vjp_outputs(rank, world_size):
    """ms.vjp: a non-scalar DTensor output raises a clear ValueError; its full_tensor() (cotangent of
    the global shape) and a scalar DTensor give one process's gradients."""
    import mindspore as ms
    from hyper_parallel import DTensor, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    y = inp("vjpy", 0, (4, 6))
    piece = ms.Tensor(np.split(y, world_size, 0)[rank])
    cot = inp("vjpc", 0, (4, 6))

    def dist(local):
        return DTensor.from_local(local, mesh, [Shard(0)]) * 3

    expect_error(ValueError, lambda: ms.vjp(dist, piece), "ms.vjp", "(4, 6)", "full_tensor()")
    out, fn = ms.vjp(lambda local: dist(local).full_tensor(), piece)
    close(out, y * 3, "vjp forward of full_tensor()")
    grad = fn(ms.Tensor(cot))
    grad = grad[0] if isinstance(grad, tuple) else grad
    close(grad, np.split(cot * 3, world_size, 0)[rank], "vjp gradient of full_tensor()")
    out, fn = ms.vjp(lambda local: (dist(local) ** 2).sum(), piece)
    close(out, np.float32((9 * y ** 2).sum()), "vjp forward of a scalar DTensor")
    grad = fn(ms.Tensor(np.float32(1.0)))
    grad = grad[0] if isinstance(grad, tuple) else grad
    close(grad, np.split(18 * y, world_size, 0)[rank], "vjp gradient of a scalar DTensor")
    return True


def scalar_left_operators(rank, world_size):
    """``2 OP d`` for every operator runs through sharding rules (HP_STRICT_DISPATCH: no replicated
    fallback; ``2 % d`` used to take it) and equals one process."""
    import os
    import mindspore as ms
    from hyper_parallel import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    x, y = _inputs()
    os.environ["HP_STRICT_DISPATCH"] = "1"
    try:
        for pname, placements in _placements().items():
            d = distribute_tensor(ms.Tensor(y - 1.0), mesh, placements)
            for scalar in (2, -2.5):
                for symbol in ("+", "-", "*", "/", "**", "%", "//"):
                    want = _apply(symbol, scalar, ms.Tensor(y - 1.0)).asnumpy()
                    got = _apply(symbol, scalar, d)
                    close(got, want, f"{scalar} {symbol} DTensor {pname}")
                    assert tuple(got.placements) == tuple(placements), (symbol, pname, got.placements)
    finally:
        os.environ.pop("HP_STRICT_DISPATCH", None)
    return True
