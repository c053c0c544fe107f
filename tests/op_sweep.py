"""Rank-side machinery of the op sweep (tests/test_op_sweep.py): every OpInfo of PyTorch's own
operator database, run on DTensors in several layouts, against the same op on the full tensors.

For one OpInfo and one of its samples, every rank builds the same inputs (seeded by the op's name),
picks a layout per tensor input from a seeded generator (Shard of any dim, Replicate, Partial
pieces that sum to the value), and checks, per layout:

* **forward**: every tensor output is a DTensor (or a plain tensor) whose full value equals the
  reference's, NaN/inf positions included, with the same dtype and global shape, and whose local
  shard has the shape its layout claims; non-tensor outputs are equal;
* **inputs untouched** by an out-of-place op (the full value of every input is unchanged);
* **in place**: the op's in-place variant leaves the same value in the DTensor input as in the
  reference (or raises);
* **gradients** of every floating input for a seeded linear loss of the outputs.

An op on DTensors may also raise instead of computing: that is fine (an "error" row) as long as it
says why. What must never happen is a different answer ("mismatch").

Every op is also run with a NaN and an inf planted in one shard of its first input (forward and
gradients), since single-device NaN semantics are what distributed reductions most easily lose.
"""
import traceback
import zlib

ATOL, RTOL = 1e-5, 1e-4
LOW_PRECISION_TOL = (1e-2, 1e-2)
# Gradients pass through more arithmetic, some of it reordered by the split (attention blocks merged
# by log-sum-exp, sums of partial products): a little more absolute room, still fp32-level.
GRAD_ATOL = 5e-5
# Gradients at NaN/inf inputs are compared too, except where torch itself computes them differently
# for a tensor subclass (any subclass, PyTorch's DTensor included) than for a plain tensor.
NAN_GRAD_EXEMPT = {
    "prod": "prod's backward takes its zero-safe (cumprod) formula for every tensor subclass, which is "
            "finite at a NaN input where the plain-tensor formula gives NaN",
}


def _gen(*parts):
    import torch
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


def _int(g, n):
    import torch
    return int(torch.randint(0, n, (1,), generator=g))


class Outcome:
    """What one op did over all its samples and layouts on this rank."""

    def __init__(self):
        self.cases, self.skipped = 0, 0
        self.fallback, self.errors, self.mismatches = set(), [], []

    def status(self):
        if self.mismatches:
            return "MISMATCH"
        if self.cases == 0:
            return "skip"
        if len(self.errors) == self.cases:
            return "error"
        return "fallback" if self.fallback else "rule"

    def summary(self):
        return {"status": self.status(), "cases": self.cases, "skipped": self.skipped,
                "fallback": sorted(self.fallback), "errors": self.errors[:2],
                "mismatches": self.mismatches[:3]}


# ================================================================================ inputs
def _leaves(sample):
    from torch.utils._pytree import tree_flatten
    return tree_flatten((sample.input, sample.args, sample.kwargs))


def _call(op_fn, structure, leaves):
    from torch.utils._pytree import tree_unflatten
    inp, args, kwargs = tree_unflatten(list(leaves), structure)
    return op_fn(inp, *args, **kwargs)


def _placement_choices(t, float_ok):
    from hyper_parallel import Partial, Replicate, Shard
    choices = [Replicate()] + [Shard(d) for d in range(t.ndim) if t.shape[d] > 0]
    if float_ok and t.is_floating_point():
        choices.append(Partial("sum"))
    return choices


def _layouts(sample_leaves, mesh, op_name, k):
    """Layout number ``k`` of a sample: a placement tuple per tensor leaf (None: stays plain).
    Layout 0 shards the first input on its largest dim; later ones are seeded random choices."""
    import torch
    from hyper_parallel import Replicate, Shard
    layout = []
    g = _gen(op_name, "layout", k)
    first = True
    for leaf in sample_leaves:
        if not torch.is_tensor(leaf) or leaf.ndim == 0:
            layout.append(None)
            continue
        if k == 0:
            if first:
                d = max(range(leaf.ndim), key=lambda i: leaf.shape[i])
                layout.append(tuple(Shard(d) if m == 0 and leaf.shape[d] > 0 else Replicate()
                                    for m in range(mesh.ndim)))
            else:
                layout.append((Replicate(),) * mesh.ndim)
        else:
            choices = _placement_choices(leaf, float_ok=True)
            picked = [choices[_int(g, len(choices))] for _ in range(mesh.ndim)]
            partial = [m for m, p in enumerate(picked) if p.is_partial()]
            for m in partial[1:]:  # one Partial mesh dim per tensor: its pieces sum in one order
                picked[m] = Replicate()
            layout.append(tuple(picked))
        first = False
    return layout


def _make(x, placements, mesh):
    """A DTensor leaf with ``placements`` whose global value is ``x``. A Partial(sum) value is held as
    unequal fractions of it (1/3 and 2/3 on two ranks): an op that treats the pieces as the value
    (a scalar added per rank, a non-linear op applied piecewise) shows, and pieces never cancel
    (cancelling pieces make exact linear algebra look wrong in floating point)."""
    from hyper_parallel import DTensor, Replicate, distribute_tensor
    base = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(x.detach(), mesh, base, src_data_rank=None).to_local().clone()
    coord = mesh.get_coordinate()
    for m, p in enumerate(placements):
        if p.is_partial():
            n = mesh.size(m)
            local = local * ((coord[m] + 1) / (n * (n + 1) / 2))
    dt = DTensor.from_local(local, mesh, placements, shape=tuple(x.shape))
    if x.requires_grad:
        dt.requires_grad_()
    return dt


def _plant(leaves, value):
    """Copies of the leaves with ``value`` at the last element of the first floating input (in the
    last rank's shard when that input is sharded on its first dim); None if there is no such input."""
    import torch
    out, done = [], False
    for leaf in leaves:
        if not done and torch.is_tensor(leaf) and leaf.is_floating_point() and leaf.numel() > 1:
            planted = leaf.detach().clone().contiguous()
            planted.view(-1)[-1] = value
            leaf = planted.requires_grad_(leaf.requires_grad)
            done = True
        out.append(leaf)
    return out if done else None


# ================================================================================ comparison
def _same(name, got, want, values=True, atol=ATOL):
    """Raise AssertionError if ``got`` (DTensor / tensor / value) differs from ``want``."""
    import torch
    from hyper_parallel import DTensor
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), \
            f"{name}: got {type(got).__name__}, expected a sequence of {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            _same(f"{name}[{i}]", a, b, values, atol)
        return
    if not torch.is_tensor(want):
        if isinstance(got, DTensor):
            got = got.full_tensor()
        if torch.is_tensor(got) and got.numel() == 1:
            got = got.item()
        assert got == want or (want != want and got != got), f"{name}: {got!r} != {want!r}"
        return
    assert torch.is_tensor(got), f"{name}: got a {type(got).__name__}, expected a tensor"
    if isinstance(got, DTensor):
        local = got.to_local()
        assert tuple(local.shape) == got._spec.local_shape, \
            f"{name}: local shape {tuple(local.shape)} does not match its layout {got.placements}"
        assert local.dtype == got.dtype, f"{name}: local dtype {local.dtype} != {got.dtype}"
        got = got.full_tensor()
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    if values:
        # half precision: a Partial value's pieces are each rounded to the narrow type before they
        # sum, so they agree with one device to that type's precision, not fp32's
        narrow = got.dtype in (torch.float16, torch.bfloat16, torch.complex32)
        tol = LOW_PRECISION_TOL if narrow else (atol, RTOL)
        torch.testing.assert_close(got.detach(), want.detach(), atol=tol[0], rtol=tol[1], equal_nan=True,
                                   msg=lambda m: f"{name}: {m}")


def _float_outputs(out):
    import torch
    from torch.utils._pytree import tree_flatten
    return [o for o in tree_flatten(out)[0]
            if torch.is_tensor(o) and o.is_floating_point() and o.requires_grad]


def _loss(outs, op_name):
    from hyper_parallel import DTensor
    import torch
    total = 0
    for i, o in enumerate(outs):
        full = o.full_tensor() if isinstance(o, DTensor) else o
        w = torch.randn(tuple(o.shape), generator=_gen(op_name, "w", i)).to(o.dtype)
        total = total + (full * w).sum()
    return total


# ================================================================================ one case
def _reference(op_fn, structure, leaves, seed=0):
    import torch
    refs = [x.detach().clone().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x for x in leaves]
    torch.manual_seed(seed)
    return refs, _call(op_fn, structure, refs)


def _seeded_call(op_fn, structure, leaves, seed):
    """The DTensor run, from the same generator state as the reference (random ops must draw what
    one device draws)."""
    import torch
    torch.manual_seed(seed)
    try:
        return _call(op_fn, structure, leaves)
    except Exception as exc:  # noqa: BLE001  (the op refused: reported as an error row)
        raise OpRefused(exc) from exc


def _exact_values(leaves, dts):
    """The reference's inputs: the DTensors' own full values. Partial pieces sum to the input only up
    to rounding, and an op that compares (``target == 1``) must see the value the DTensor holds."""
    from hyper_parallel import DTensor
    return [d.full_tensor().detach().requires_grad_(x.requires_grad) if isinstance(d, DTensor) else x
            for x, d in zip(leaves, dts)]


def _distribute(leaves, layout, mesh):
    return [_make(x, p, mesh) if p is not None else x for x, p in zip(leaves, layout)]


def check_layout(op, op_fn, structure, leaves, layout, mesh, tag, grads=True):
    """One sample in one layout: forward, untouched inputs, gradients. Raises AssertionError on a
    mismatch; any other exception from the DTensor run is the op's own error."""
    from hyper_parallel import DTensor
    seed = zlib.crc32(tag.encode())
    dts = _distribute(leaves, layout, mesh)
    refs, want = _reference(op_fn, structure, _exact_values(leaves, dts), seed)
    got = _seeded_call(op_fn, structure, dts, seed)
    _same("output", got, want, values=op.name not in UNINITIALISED)
    for i, (d, r) in enumerate(zip(dts, refs)):
        if isinstance(d, DTensor):  # unchanged, or changed as on one device (e.g. running stats)
            _same(f"input {i} after the op", d.detach(), r.detach())
    outs_ref = _float_outputs(want)
    if not grads or not outs_ref or not op.supports_autograd:
        return
    _loss(outs_ref, op.name).backward()
    try:
        _loss(_float_outputs(got), op.name).backward()
    except Exception as exc:  # noqa: BLE001
        raise OpRefused(exc) from exc
    for i, (r, d) in enumerate(zip(refs, dts)):
        if not isinstance(d, DTensor) or not d.requires_grad:
            continue
        if r.grad is None:
            assert d.grad is None or not d.grad.full_tensor().any(), f"input {i}: unexpected gradient"
            continue
        assert d.grad is not None, f"input {i}: no gradient"
        _same(f"gradient of input {i}", d.grad, r.grad, atol=GRAD_ATOL)


def check_inplace(op, structure, leaves, layout, mesh, tag):
    """The op's in-place variant writes the same value into the DTensor input as on one device."""
    import torch
    fn = op.get_inplace()
    plain = [x.detach() if torch.is_tensor(x) else x for x in leaves]
    seed = zlib.crc32(tag.encode())
    try:
        refs, _ = _reference(fn, structure, plain, seed)
    except Exception:  # noqa: BLE001  (torch itself refuses this sample in place)
        return
    dts = _distribute(plain, layout, mesh)
    refs, _ = _reference(fn, structure, _exact_values(plain, dts), seed)
    _seeded_call(fn, structure, dts, seed)
    _same("in-place target", dts[0], refs[0])


class OpRefused(Exception):
    """The DTensor run raised: allowed (an error row), never silently wrong."""


# ================================================================================ the driver
# Ops whose result at a NaN / inf input is undefined in torch itself, so it depends on shard shapes:
# the polynomial degree n is cast to an integer (the kernel's vectorised and scalar paths disagree);
# scaled_dot_product_attention's own kernels disagree on a NaN query row (math: NaN, flash: zeros).
NAN_UNDEFINED = ("special.chebyshev_polynomial", "special.hermite_polynomial", "special.laguerre_polynomial",
                 "special.legendre_polynomial", "special.shifted_chebyshev_polynomial",
                 "nn.functional.scaled_dot_product_attention")

# Ops whose output is uninitialised memory: only shape, dtype and layout are compared.
UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


def _dtype(op):
    import torch
    supported = op.supported_dtypes("cpu")
    for dtype in (torch.float32, torch.int64, torch.bool, torch.complex64):
        if dtype in supported:
            return dtype
    return None


def _samples(op, dtype, count):
    import torch
    torch.manual_seed(zlib.crc32(op.full_name.encode()))
    grad = op.supports_autograd and dtype.is_floating_point
    out = []
    for sample in op.sample_inputs("cpu", dtype, requires_grad=grad):
        out.append(sample)
        if len(out) >= count:
            break
    return out


def _run_case(op, outcome, run, tag):
    """Run one check; file its result under ``outcome``. Seeded alike for reference and DTensor runs
    (random ops must match single device under the same seed)."""
    import torch
    from hyper_parallel.core.dtensor.dispatch.fallback import recording_fallbacks
    torch.manual_seed(zlib.crc32(tag.encode()))
    try:
        with recording_fallbacks() as names:
            run()
        outcome.cases += 1
        outcome.fallback |= names
    except OpRefused as exc:
        outcome.cases += 1
        outcome.errors.append(f"{tag}: {type(exc.__cause__).__name__}: {str(exc.__cause__)[:200]}")
    except Exception as exc:  # noqa: BLE001  (a wrong answer, or the check itself broke)
        outcome.cases += 1
        outcome.mismatches.append(f"{tag}: {type(exc).__name__}: {str(exc)[:600]}\n"
                                  f"{traceback.format_exc(limit=-4)}")


def sweep_op(op, mesh, samples=1, layouts=2, nan=True, inplace=True):
    import torch
    outcome = Outcome()
    dtype = _dtype(op)
    if dtype is None:
        return outcome.summary()
    try:
        cases = _samples(op, dtype, samples)
    except Exception:  # noqa: BLE001  (the OpInfo cannot build CPU samples here)
        return outcome.summary()
    for s, sample in enumerate(cases):
        leaves, structure = _leaves(sample)
        if any(torch.is_tensor(x) and (x.layout != torch.strided or x.is_quantized) for x in leaves):
            outcome.skipped += 1  # sparse / quantized samples: DTensor is a strided layout
            continue
        variants = [("plain", leaves)]
        if nan and dtype.is_floating_point and not op.name.startswith(NAN_UNDEFINED):
            for name, value in (("nan", float("nan")), ("inf", float("inf"))):
                planted = _plant(leaves, value)
                if planted is not None:
                    variants.append((name, planted))
        for vname, vleaves in variants:
            try:
                _reference(op.op, structure, vleaves)
            except Exception:  # noqa: BLE001
                outcome.skipped += 1
                continue
            for k in range(layouts if vname == "plain" else 1):
                layout = _layouts(vleaves, mesh, op.full_name, k * 7 + s)
                tag = f"{op.full_name}/s{s}/{vname}/L{k}{_describe(layout)}"
                grads = vname == "plain" or op.name not in NAN_GRAD_EXEMPT
                _run_case(op, outcome, lambda: check_layout(op, op.op, structure, vleaves, layout, mesh, tag,
                                                            grads=grads), tag)
            has_inplace = op.inplace_variant is not None and torch.is_tensor(sample.input)
            if inplace and vname == "plain" and has_inplace:
                layout = _layouts(vleaves, mesh, op.full_name, 1 + s)
                tag = f"{op.full_name}/s{s}/inplace{_describe(layout)}"
                _run_case(op, outcome, lambda: check_inplace(op, structure, vleaves, layout, mesh, tag), tag)
    return outcome.summary()


def _describe(layout):
    return "[" + ",".join("-" if p is None else "".join(repr(x) for x in p) for p in layout) + "]"


def select_ops(names=None, shard=None):
    """OpInfos of op_db by full name, or every one; ``shard=(i, n)`` keeps every n-th from i.
    ``HP_OP_SWEEP_ONLY=name1,name2`` (full names) narrows any run to those ops, e.g. to check the
    rules of a few ops on several meshes without sweeping the whole database."""
    import os
    from torch.testing._internal.common_methods_invocations import op_db
    only = {n.strip() for n in os.environ.get("HP_OP_SWEEP_ONLY", "").split(",") if n.strip()}
    ops = [op for op in op_db
           if (names is None or op.full_name in names) and (not only or op.full_name in only)]
    if shard is not None:
        i, n = shard
        ops = ops[i::n]
    return ops


def sweep(rank, world_size, mesh_shape, names=None, shard=None, samples=1, layouts=2):
    """Run on every rank; returns {op full name: summary} (identical on every rank when the ops
    are deterministic)."""
    import warnings
    from hyper_parallel import init_device_mesh
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in select_ops(names, shard):
            results[op.full_name] = sweep_op(op, mesh, samples=samples, layouts=layouts)
    return results
