"""The MoE network of ``python -m benchmarks.moe``: blocks of a replicated top-k router and stacked
SwiGLU experts in the Hugging Face 5.x layout (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)),
a residual and a layer norm. The experts module's own forward is the dense per-expert loop Hugging
Face runs (what data_parallel / fully_shard with replicated experts compute); ExpertParallel
replaces it with the dispatch."""


def build(torch, hidden, experts, inter, top_k, layers, seed=0):
    from torch import nn

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * hidden ** -0.5)
            self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) * inter ** -0.5)
            self.act_fn = nn.SiLU()

        def forward(self, x, index, weights):
            out = torch.zeros_like(x)
            for e in range(experts):
                token, k = torch.where(index == e)
                gate, up = nn.functional.linear(x[token], self.gate_up_proj[e]).chunk(2, -1)
                y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
                out = out.index_add(0, token, y * weights[token, k, None])
            return out

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(hidden, experts, bias=False)
            self.experts = Experts()
            self.norm = nn.LayerNorm(hidden)

        def forward(self, x):
            probs = self.gate(x).softmax(-1)
            weights, index = probs.topk(top_k, -1)
            return self.norm(x + self.experts(x, index, weights / weights.sum(-1, keepdim=True)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(hidden, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))

        def forward(self, x):
            x = self.inp(x)    # the first block's input has a gradient (all four exchanges run)
            for block in self.blocks:
                x = block(x)
            return x
    torch.manual_seed(seed)
    return Net()


def expert_bytes(model):
    """Bytes of the expert tensors this rank holds (the local shard of a DTensor)."""
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


class RoutingRecorder:
    """Records each experts module's top-k indices as it is called (a forward pre-hook): the
    routing counts the closed form is computed from."""

    def __init__(self, torch, model, experts):
        self.torch, self.experts, self.counts = torch, experts, []
        self.handles = [block.experts.register_forward_pre_hook(self._hook) for block in model.blocks]

    def _hook(self, _module, args):
        counts = self.torch.bincount(args[1].flatten(), minlength=self.experts)
        self.counts.append(counts[:self.experts].tolist())

    def remove(self):
        for handle in self.handles:
            handle.remove()
