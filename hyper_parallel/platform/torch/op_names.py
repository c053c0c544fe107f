"""Map torch callables to the framework-neutral op names that core's sharding rules use.

Several torch spellings reach one rule (``torch.matmul``, ``Tensor.matmul``, ``Tensor.__matmul__``
and ``torch.mm`` all mean "matmul"). In-place methods are deliberately absent: they stay on the
aten path where autograd tracks them on the DTensor itself.
"""
from typing import Any, Dict, List
import torch
import torch.nn.functional as F

_EXPLICIT: Dict[str, List[Any]] = {
    "matmul": [torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
               torch.bmm, torch.Tensor.bmm, torch.mv, torch.Tensor.mv],
    "addmm": [torch.addmm, torch.Tensor.addmm],
    "baddbmm": [torch.baddbmm, torch.Tensor.baddbmm],
    "addmv": [torch.addmv, torch.Tensor.addmv],
    "einsum": [torch.einsum],
    "rmatmul": [torch.Tensor.__rmatmul__],
    "linear": [F.linear],
    "view": [torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.flatten, torch.Tensor.flatten,
             torch.Tensor.unflatten, torch.unflatten, torch.Tensor.view_as, torch.Tensor.reshape_as,
             torch.squeeze, torch.Tensor.squeeze, torch.unsqueeze, torch.Tensor.unsqueeze],
    "expand": [torch.Tensor.expand, torch.Tensor.expand_as],
    "view_as_real": [torch.view_as_real],
    "view_as_complex": [torch.view_as_complex],
    "transpose": [torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes,
                  torch.swapdims, torch.Tensor.swapdims],
    "permute": [torch.permute, torch.Tensor.permute],
    "movedim": [torch.movedim, torch.Tensor.movedim, torch.moveaxis, torch.Tensor.moveaxis],
    "t": [torch.t, torch.Tensor.t],
    "identity": [torch.Tensor.contiguous, torch.clone, torch.Tensor.clone],
    "cast": [torch.Tensor.to, torch.Tensor.float, torch.Tensor.double, torch.Tensor.half,
             torch.Tensor.bfloat16, torch.Tensor.type_as],
    "split": [torch.split, torch.Tensor.split],
    "chunk": [torch.chunk, torch.Tensor.chunk],
    "unbind": [torch.unbind, torch.Tensor.unbind],
    "tensor_split": [torch.tensor_split, torch.Tensor.tensor_split],
    "narrow": [torch.narrow, torch.Tensor.narrow],
    "getitem": [torch.Tensor.__getitem__],
    "cat": [torch.cat, torch.concat, torch.concatenate],
    "stack": [torch.stack],
    "softmax": [F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax,
                torch.Tensor.log_softmax],
    "sum": [torch.sum, torch.Tensor.sum],
    "mean": [torch.mean, torch.Tensor.mean],
    "amax": [torch.amax, torch.Tensor.amax],
    "amin": [torch.amin, torch.Tensor.amin],
    # max / min are a reduction (no dim, or dim -> values and indices) or elementwise (other tensor)
    "max": [torch.max, torch.Tensor.max],
    "min": [torch.min, torch.Tensor.min],
    "embedding": [F.embedding],
    "layer_norm": [F.layer_norm],
    "rms_norm": [getattr(F, "rms_norm", None)],
    "dropout": [F.dropout, torch.dropout],
    "sdpa": [F.scaled_dot_product_attention],
    "cross_entropy": [F.cross_entropy],
    "nll_loss": [F.nll_loss],
    "mse_loss": [F.mse_loss],
    "var": [torch.var, torch.Tensor.var],
    "std": [torch.std, torch.Tensor.std],
    "var_mean": [torch.var_mean],
    "std_mean": [torch.std_mean],
    "logsumexp": [torch.logsumexp, torch.Tensor.logsumexp, torch.special.logsumexp],
    "vector_norm": [torch.linalg.vector_norm],
    "norm": [torch.norm, torch.Tensor.norm],
    "index_select": [torch.index_select, torch.Tensor.index_select],
    "gather": [torch.gather, torch.Tensor.gather],
    "scatter": [torch.scatter, torch.Tensor.scatter, torch.scatter_add, torch.Tensor.scatter_add,
                torch.scatter_reduce, torch.Tensor.scatter_reduce],
    "new_factory": [torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
                    torch.Tensor.new_empty],
    "pad": [F.pad],
}
# ops along one dim (ops/whole_dim.py, ops/scan.py): the rule name is the torch name
for _name in ("argmax", "argmin", "median", "nanmedian", "mode", "kthvalue", "prod", "topk", "sort",
              "argsort", "cumsum", "cummax", "cummin", "logcumsumexp"):
    _EXPLICIT[_name] = [getattr(torch, _name), getattr(torch.Tensor, _name)]

_DUNDER_ELEMENTWISE = ["__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
                       "__rtruediv__", "__div__", "__pow__", "__rpow__", "__neg__", "__abs__", "__and__",
                       "__rand__", "__or__", "__ror__", "__xor__", "__invert__", "__eq__", "__ne__",
                       "__lt__", "__le__", "__gt__", "__ge__", "__floordiv__", "__mod__"]
# Pointwise by tag but not elementwise in every overload, or needing a rule of their own.
_NOT_ELEMENTWISE = {"where_single_arg", "dropout", "copy", "fill", "zero", "to"}


def _pointwise_names():
    names = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket) or name.endswith("_"):
            continue
        overloads = [getattr(packet, o) for o in packet.overloads()]
        if any(torch.Tag.pointwise in op.tags for op in overloads) and name not in _NOT_ELEMENTWISE:
            names.append(name)
    return names


def build_op_names() -> Any:
    table = {}
    for name in _pointwise_names():
        for namespace in (torch, torch.Tensor, F, torch.special):
            func = getattr(namespace, name, None)
            if callable(func):
                table[func] = "elementwise"
    for name in _DUNDER_ELEMENTWISE:
        table[getattr(torch.Tensor, name)] = "elementwise"
    for func in (F.relu, F.gelu, F.silu, F.sigmoid, F.tanh, torch.where, torch.Tensor.where,
                 torch.Tensor.masked_fill, torch.masked_fill):
        table[func] = "elementwise"
    for name, funcs in _EXPLICIT.items():
        for func in funcs:
            if func is not None:
                table[func] = name
    return table
