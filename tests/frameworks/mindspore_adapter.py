"""The MindSpore side of the test-case adapter (see tests/frameworks/__init__.py and
torch_adapter.TorchAdapter for the interface)."""
import numpy as np
import mindspore as ms
from mindspore import mint, ops

from hyper_parallel.platform.mindspore import scaled_dot_product_attention

MF = mint.nn.functional


class MindSporeOps:
    """Functional ops under neutral names, spelled the way MindSpore users write them."""
    exp, tanh, relu, where = staticmethod(ops.exp), staticmethod(ops.tanh), staticmethod(ops.relu), \
        staticmethod(ops.where)
    matmul, bmm, linear = staticmethod(ops.matmul), staticmethod(ops.bmm), staticmethod(MF.linear)

    @staticmethod
    def softmax(a, dim):
        return ops.softmax(a, dim)

    @staticmethod
    def log_softmax(a, dim):
        return ops.log_softmax(a, dim)

    @staticmethod
    def cat(tensors, dim):
        return ops.cat(tensors, dim)

    @staticmethod
    def dropout(a, p):
        return ops.dropout(a, p=p)

    @staticmethod
    def half_roundtrip(a):
        return a.astype(ms.float16).astype(ms.float32)

    @staticmethod
    def sdpa(q, k, v, mask=None, causal=False):
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    @staticmethod
    def cumsum(a, dim):
        return ops.cumsum(a, dim)

    @staticmethod
    def embedding(ids, table):
        return ops.gather(table, ids, 0)   # what nn.Embedding runs (mint's kernel is not on CPU)

    @staticmethod
    def cumprod(a, dim):
        return ops.cumprod(a, dim)

    @staticmethod
    def trace(a):
        return ops.trace(a)


class MindSporeAdapter:
    name = "mindspore"
    ops = MindSporeOps

    # ------------------------------------------------------------------ tensors
    @staticmethod
    def tensor(array):
        return ms.Tensor(np.array(array, order="C"))

    @staticmethod
    def numpy(x):
        return x.asnumpy()

    @staticmethod
    def is_plain_tensor(x):
        return type(x) is ms.Tensor

    @staticmethod
    def noncontiguous(array):
        if array.ndim < 2:
            return ms.Tensor(np.array(array))
        view = ms.Tensor(np.ascontiguousarray(np.swapaxes(array, 0, 1))).swapaxes(0, 1)
        assert not view.is_contiguous()
        return view

    # ------------------------------------------------------------------ autograd
    @staticmethod
    def grad(fn, *inputs):
        grads = ms.grad(fn, grad_position=tuple(range(len(inputs))))(*inputs)
        return grads if isinstance(grads, tuple) else (grads,)

    # ------------------------------------------------------------------ modules
    @staticmethod
    def attention(kind="sdpa", layout="bshd"):
        class Attention(ms.nn.Cell):
            def construct(self, q, k, v, mask=None, causal=False):
                if layout == "bshd":
                    q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
                gqa = q.shape[-3] != k.shape[-3]
                if kind == "sdpa":
                    o = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
                else:
                    if gqa:
                        rep = q.shape[-3] // k.shape[-3]
                        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
                    scores = ops.matmul(q, k.swapaxes(-2, -1)) * (q.shape[-1] ** -0.5)
                    if causal:
                        sq, sk = q.shape[-2], k.shape[-2]
                        allowed = ops.tril(mint.ones((sq, sk), dtype=ms.int32), sk - sq).astype(ms.bool_)
                        scores = scores.masked_fill(~allowed, float("-inf"))
                    if mask is not None:
                        scores = scores.masked_fill(~mask, float("-inf"))
                    o = ops.matmul(ops.softmax(scores, -1), v)
                return o.swapaxes(1, 2) if layout == "bshd" else o
        return Attention()

    @staticmethod
    def mlp(kind, dim, hidden):
        """``kind``: "mint" (mint.nn.Linear) or "dense" (nn.Dense)."""
        def linear(i, o):
            return mint.nn.Linear(i, o) if kind == "mint" else ms.nn.Dense(i, o)

        class MLP(ms.nn.Cell):
            def __init__(self):
                super().__init__()
                self.w1, self.w2 = linear(dim, hidden), linear(hidden, dim)

            def construct(self, x):
                return self.w2(ops.relu(self.w1(x)))
        return MLP()

    @staticmethod
    def projections(dim, out, names=("wq", "wk", "wv")):
        class Projections(ms.nn.Cell):
            def __init__(self):
                super().__init__()
                for name in names:
                    setattr(self, name, mint.nn.Linear(dim, out))

            def construct(self, x):
                return tuple(getattr(self, name)(x) for name in names)
        return Projections()

    @staticmethod
    def parameter_shapes(cell):
        return {name: tuple(p.shape) for name, p in cell.parameters_and_names()}

    @staticmethod
    def set_parameters(cell, arrays):
        for name, param in cell.parameters_and_names():
            param.set_data(ms.Tensor(arrays[name]))

    @staticmethod
    def grads_then_sgd(cell, loss_fn, x, lr, input_grad=True):
        params = cell.trainable_params()
        if input_grad:
            _, (dx, dw) = ms.value_and_grad(loss_fn, grad_position=0, weights=params)(x)
        else:
            (_, dw), dx = ms.value_and_grad(loss_fn, grad_position=None, weights=params)(x), None
        grads = {p.name: g.asnumpy() for p, g in zip(params, dw)}
        ms.nn.SGD(params, learning_rate=lr)(dw)
        return (dx.asnumpy() if input_grad else None), grads

    @staticmethod
    def embedding_module(vocab, dim):
        return ms.nn.Embedding(vocab, dim)   # a Gather on its embedding_table

    # ------------------------------------------------------------------ framework-specific checks
    @staticmethod
    def extra_op_cases():
        """mint's functional spellings (a different operator set from ops.*)."""
        return [("mint softmax/dropout", lambda a: MF.softmax(a, dim=0) + MF.dropout(a, 0.0), [(4, 6)],
                 [["S0", "S1", "R"]])]

    @staticmethod
    def unsupported_dtensor_operations(dt):
        """In-place operators, item assignment and asnumpy() on a DTensor raise (not silently
        act on one shard)."""
        return [lambda: dt.add_(1.0), lambda: dt.__setitem__(0, 1.0), lambda: dt.asnumpy()]
