"""A CPU stand-in for ``torch_npu``, for tests only: ``npu_fusion_attention`` in plain torch.

It implements the documented semantics of Ascend's fused attention kernel for what
hyper_parallel's sharding rule relies on (docs/ascend.md):

* layouts BSH, SBH (hidden = heads x dim), BSND, BNSD and TND (sequences packed along T,
  ``actual_seq_qlen`` / ``actual_seq_kvlen`` = cumulative sequence ends; each sequence attends
  only within itself);
* ``head_num`` = query heads N1; key/value heads N2 divide N1 (GQA);
* ``atten_mask`` True = masked out; sparse_mode 0 (no mask: full attention, pre/next tokens
  ignored; with a full mask: the mask and the band ``i - pre <= j <= i + next``, from the top-left
  corner), 1 (the full mask alone), 2 (left-up causal ``j <= i``), 3 (right-down causal
  ``j <= i + Skv - Sq``), 4 (band from the bottom-right corner,
  ``i + Skv - Sq - pre <= j <= i + Skv - Sq + next``); 2/3/4 require the compressed 2048x2048 mask
  (as the real kernel does) and ignore its content;
* returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``:
  softmax_max / softmax_sum fp32 (B, N1, Sq, 8) (TND: (T, N1, 8)) holding the row max of the
  scaled scores and the sum of exp(score - max), softmax_out an empty tensor (reserved);
* differentiable in query, key and value (plain autograd); rows that see no key give zeros.

Like the C++ binding of the real kernel, the function honours ``__torch_function__`` of tensor
subclasses (so DTensor inputs reach hyper_parallel's rule), and it runs on meta tensors (which
the dispatcher uses for output shapes). Not emulated: pse, padding_mask, dropout (keep_prob < 1),
prefix / varlen outer-cut modes 5-8 (they raise).
"""
import contextlib
import importlib.machinery
import sys
import types

import torch
from torch.overrides import handle_torch_function, has_torch_function

INT_MAX = 2147483647
COMPRESSED = 2048
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def compressed_mask(device=None):
    """The optimized mask sparse modes 2/3/4 take: upper triangle of 2048x2048 (True = masked)."""
    return torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=device).triu(1)


def visible_keys(mode, pre, nxt, sq, skv, atten_mask=None, device=None):
    """(..., sq, skv) bool, True where a query row may attend a key; None = everything visible."""
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(skv, device=device).unsqueeze(0)
    d = skv - sq
    if mode == 0:
        if atten_mask is None:
            return None
        return ~atten_mask.bool() & (j >= i - pre) & (j <= i + nxt)
    if mode == 1:
        if atten_mask is None:
            raise ValueError("sparse_mode=1 (allMask) needs atten_mask")
        return ~atten_mask.bool()
    if mode == 2:
        return j <= i
    if mode == 3:
        return j <= i + d
    if mode == 4:
        return (j >= i + d - pre) & (j <= i + d + nxt)
    raise NotImplementedError(f"sparse_mode={mode} is not emulated")


def _attend(q, k, v, allowed, scale):
    """q (B, N1, Sq, D), k/v (B, N2, Skv, D); fp32 math; returns out, row max, row sum."""
    n1, n2 = q.shape[1], k.shape[1]
    if n1 % n2:
        raise ValueError(f"query heads {n1} are not a multiple of key/value heads {n2}")
    if n1 != n2:
        k, v = k.repeat_interleave(n1 // n2, 1), v.repeat_interleave(n1 // n2, 1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    shift = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max).detach()
    p = torch.exp(scores - shift)
    row_sum = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v.float()) / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    stats = [t.detach().expand(*t.shape[:-1], 8).contiguous() for t in (row_max, row_sum)]
    return out.to(q.dtype), stats[0], stats[1]


def _to_bnsd(t, layout, heads):
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, heads, h // heads).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.view(s, b, heads, h // heads).permute(1, 2, 0, 3)
    if layout == "BSND":
        return t.transpose(1, 2)
    return t


def _from_bnsd(t, layout):
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).reshape(s, b, n * d)
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    return t.contiguous()


def _check_mask(mode, atten_mask, sq, skv):
    if mode in (2, 3, 4):
        if atten_mask is None or tuple(atten_mask.shape) != (COMPRESSED, COMPRESSED):
            got = None if atten_mask is None else tuple(atten_mask.shape)
            raise ValueError(f"sparse_mode={mode} needs the compressed {COMPRESSED}x{COMPRESSED} atten_mask, "
                             f"got {got}")
        return None
    if atten_mask is not None and tuple(atten_mask.shape[-2:]) != (sq, skv):
        raise ValueError(f"atten_mask {tuple(atten_mask.shape)} must end in (Sq, Skv) = ({sq}, {skv})")
    return atten_mask


def _impl(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
          scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0, prefix=None,
          actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    layout = input_layout.upper()
    if layout not in LAYOUTS:
        raise ValueError(f"input_layout {input_layout!r} is not one of {LAYOUTS}")
    if pse is not None or padding_mask is not None or prefix is not None:
        raise NotImplementedError("pse / padding_mask / prefix are not emulated")
    if keep_prob != 1.0:
        raise NotImplementedError("dropout (keep_prob < 1) is not emulated")
    mode, pre, nxt = int(sparse_mode), int(pre_tockens), int(next_tockens)
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    if layout == "TND":
        if actual_seq_qlen is None or actual_seq_kvlen is None or \
                len(actual_seq_qlen) != len(actual_seq_kvlen):
            raise ValueError("TND needs actual_seq_qlen and actual_seq_kvlen of equal length")
        cq, ckv = [int(x) for x in actual_seq_qlen], [int(x) for x in actual_seq_kvlen]
        if cq[-1] != query.shape[0] or ckv[-1] != key.shape[0]:
            raise ValueError(f"cumulative lengths {cq[-1]}/{ckv[-1]} must equal T "
                             f"{query.shape[0]}/{key.shape[0]}")
        if query.shape[1] != head_num:
            raise ValueError(f"head_num={head_num} but query has {query.shape[1]} heads")
        if mode in (2, 3, 4):
            _check_mask(mode, atten_mask, None, None)
        if atten_mask is not None and mode in (0, 1):
            raise NotImplementedError("an explicit TND atten_mask is not emulated")
        outs, maxes, sums = [], [], []
        q0 = k0 = 0
        for q1, k1 in zip(cq, ckv):
            if q1 < q0 or k1 < k0:
                raise ValueError("actual_seq_qlen / actual_seq_kvlen must be non-decreasing")
            qb, kb, vb = (t[a:b].permute(1, 0, 2).unsqueeze(0) for t, a, b in
                          ((query, q0, q1), (key, k0, k1), (value, k0, k1)))
            allowed = visible_keys(mode, pre, nxt, q1 - q0, k1 - k0, None, query.device)
            o, m, s = _attend(qb, kb, vb, allowed, scale)
            outs.append(o[0].permute(1, 0, 2))
            maxes.append(m[0].permute(1, 0, 2))
            sums.append(s[0].permute(1, 0, 2))
            q0, k0 = q1, k1
        return (torch.cat(outs, 0), torch.cat(maxes, 0), torch.cat(sums, 0), empty, 0, 0, 0)
    if layout in ("BSH", "SBH"):
        if query.shape[2] % head_num:
            raise ValueError(f"hidden size {query.shape[2]} is not a multiple of head_num={head_num}")
        dim = query.shape[2] // head_num
        q, k, v = (_to_bnsd(t, layout, t.shape[2] // dim) for t in (query, key, value))
    else:
        q, k, v = (_to_bnsd(t, layout, None) for t in (query, key, value))
    if q.shape[1] != head_num:
        raise ValueError(f"head_num={head_num} but query has {q.shape[1]} heads ({layout})")
    sq, skv = q.shape[2], k.shape[2]
    mask = _check_mask(mode, atten_mask, sq, skv)
    allowed = visible_keys(mode, pre, nxt, sq, skv, mask, query.device)
    out, row_max, row_sum = _attend(q, k, v, allowed, scale)
    return (_from_bnsd(out, layout), row_max, row_sum, empty, 0, 0, 0)


def npu_fusion_attention(*args, **kwargs):
    """Emulated ``torch_npu.npu_fusion_attention`` (signature and results as the real one)."""
    relevant = tuple(x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor))
    if has_torch_function(relevant):
        return handle_torch_function(npu_fusion_attention, relevant, *args, **kwargs)
    return _impl(*args, **kwargs)


# ---------------------------------------------------------------------------- the fake module
def _make_module():
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.__version__ = "0.0+cpu.emulation"
    module.__doc__ = "CPU emulation of torch_npu for hyper_parallel's tests (tests/npu_emulation)."
    module.EMULATED = True
    module.npu_fusion_attention = npu_fusion_attention
    return module


def install():
    """Put the emulation into ``sys.modules['torch_npu']`` (idempotent) and return it."""
    existing = sys.modules.get("torch_npu")
    if existing is not None:
        if getattr(existing, "EMULATED", False):
            return existing
        raise RuntimeError("a real torch_npu is loaded in this process; refusing to shadow it")
    module = _make_module()
    sys.modules["torch_npu"] = module
    return module


def uninstall():
    if getattr(sys.modules.get("torch_npu"), "EMULATED", False):
        del sys.modules["torch_npu"]


@contextlib.contextmanager
def npu_path():
    """In a test process whose platform is the (CPU) torch platform: install the emulation and
    register its kernel for DTensor dispatch exactly as ``NpuPlatform`` registers the real one, so
    that ``torch_npu.npu_fusion_attention`` on DTensors runs through the NPU sharding rule. Yields
    the fake module; on exit the registration and the module are removed again (pool workers
    outlive the case)."""
    from hyper_parallel.platform.npu.op_names import register_npu_op_names
    from hyper_parallel.platform.torch.dtensor_base import OP_NAMES

    installed_here = "torch_npu" not in sys.modules
    module = install()
    registered = register_npu_op_names(module)
    try:
        yield module
    finally:
        for func in registered:
            OP_NAMES.pop(func, None)
        if installed_here:
            uninstall()


def cpu_npu_platform():
    """An ``NpuPlatform`` that runs on CPU/gloo (test-only subclass: device ``cpu``, backend
    ``gloo``); needs the emulation installed. It is not made the process-wide platform: core already
    holds the worker's torch platform, whose DTensor base NpuPlatform shares."""
    from hyper_parallel.platform.npu.platform import NpuPlatform

    class CpuNpuPlatform(NpuPlatform):
        device_type = property(lambda self: "cpu")
        default_backend = property(lambda self: "gloo")

        def _device_module(self):
            return torch.cpu

    return CpuNpuPlatform()
