"""Models and the one-process reference loop shared by the fully_shard tests and benchmark.

Sizes are chosen uneven on purpose: 10 and 13 rows split over 4 ranks as 3/3/3/1 and 4/4/4/1, and
the 3-row head leaves rank 3 an empty shard.
"""
import copy

import torch
from torch import nn

D_IN, HIDDEN, INNER, OUT = 6, 10, 13, 3


class Block(nn.Module):
    def __init__(self, hidden=HIDDEN, inner=INNER):
        super().__init__()
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        return self.norm(x + self.down(torch.tanh(self.up(x))))


class Net(nn.Module):
    def __init__(self, blocks=2, hidden=HIDDEN, inner=INNER):
        super().__init__()
        self.inp = nn.Linear(D_IN, hidden)
        self.blocks = nn.ModuleList(Block(hidden, inner) for _ in range(blocks))
        self.head = nn.Linear(hidden, OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Attention(nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class AttnBlock(nn.Module):
    """(batch, seq, hidden) -> same; causal attention over the sequence, heads of 4."""

    def __init__(self, hidden=8):
        super().__init__()
        # no bias: a k bias has a zero gradient, whose rounding noise Adam would amplify
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden)
        self.attn = Attention()

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, d // 4, 4).permute(2, 0, 3, 1, 4)
        return x + self.out(self.attn(q, k, v).transpose(1, 2).reshape(b, s, d))


class AttnNet(Net):
    def __init__(self, blocks=2, hidden=8):
        super().__init__(blocks, hidden)
        self.blocks = nn.ModuleList(AttnBlock(hidden) for _ in range(blocks))


def seq_batch(step, index, seq=8):
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(1, seq, D_IN, generator=g)


def net(seed=0, **kwargs):
    torch.manual_seed(seed)
    return Net(**kwargs)


def net_attn(seed=0):
    torch.manual_seed(seed)
    return AttnNet()


def batch(step, index, rows=5):
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(rows, D_IN, generator=g)


def loss_fn(out):
    return out.pow(2).mean()


def shard_net(model, mesh, **kwargs):
    from hyper_parallel import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh, **kwargs)
    return fully_shard(model, mesh, **kwargs)


def reference_step(model, step, indices, weight, mp_dtype=None, batch_fn=batch):
    """Gradients of ``weight * sum_i loss(batch_i)`` on one process (``mp_dtype``: each batch in a
    copy cast to that dtype, its gradients cast back and summed in fp32, as fully_shard's
    reduction does). Returns the per-batch losses."""
    losses = []
    if mp_dtype is None:
        total = 0
        for i in indices:
            loss = loss_fn(model(batch_fn(step, i)))
            losses.append(loss.detach())
            total = total + weight * loss
        total.backward()
        return losses
    grads = None
    for i in indices:
        low = copy.deepcopy(model).to(mp_dtype)
        loss = loss_fn(low(batch_fn(step, i).to(mp_dtype)))
        loss.backward()
        losses.append(loss.detach())
        g = [p.grad.float() for p in low.parameters()]
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    for p, g in zip(model.parameters(), grads):
        p.grad = g * weight
    return losses


def full(t):
    from hyper_parallel import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_grads(model, ref, what, tol=1e-5):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what} {name}: grad presence"
        if q.grad is not None:
            torch.testing.assert_close(full(p.grad), q.grad, atol=tol, rtol=tol,
                                       msg=lambda m: f"{what} {name} grad: {m}")


def assert_weights(model, ref, what, tol=1e-5):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.detach()), q.detach(), atol=tol, rtol=tol,
                                   msg=lambda m: f"{what} {name} weight: {m}")
