"""ExpertParallel on per-expert module lists (core/expert_parallel/module_list.py): MoE blocks written as
Hugging Face 4.x did (Mixtral's w1/w2/w3 experts, Qwen2-MoE's gated shared expert), DeepSeek-V2's own
code (a MoEGate returning indices and weights, shared experts) and a plain user model (a list of
Sequential experts routed by a user function), split over 2 (and 4, -m ep_full) ranks against the
same block in one process on the global batch: forward output and router logits, router / shared /
expert gradients, and the loss after an AdamW step (fp32, 1e-5); each rank holds E / ep experts."""
import pytest

from tests.harness import run_dist

H, E, INTER = 8, 8, 6


def _blocks():
    """{name: constructor} of the four blocks (torch imported in the worker)."""
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Top2MLP(nn.Module):              # Mixtral 4.x: w2(act(w1 x) * w3 x)
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(H, INTER, bias=False), nn.Linear(H, INTER, bias=False)
            self.w2, self.act_fn = nn.Linear(INTER, H, bias=False), nn.SiLU()

        def forward(self, x):
            return self.w2(self.act_fn(self.w1(x)) * self.w3(x))

    class MLP(nn.Module):                  # Qwen2-MoE / DeepSeek-V2 experts
        def __init__(self, inter=INTER):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(H, inter, bias=False), nn.Linear(H, inter, bias=False)
            self.down_proj = nn.Linear(inter, H, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def loop(block, flat, index, weights):
        """The 4.x expert loop: each expert on its tokens, weighted, index_add-ed."""
        final = torch.zeros_like(flat)
        for e in range(len(block.experts)):
            tok, k = torch.where(index == e)
            if tok.numel():
                final = final.index_add(0, tok, block.experts[e](flat[tok]) * weights[tok, k, None])
        return final

    class MixtralBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k, self.gate = 2, nn.Linear(H, E, bias=False)
            self.experts = nn.ModuleList([Top2MLP() for _ in range(E)])

        def forward(self, hidden):
            flat = hidden.reshape(-1, H)
            logits = self.gate(flat)
            weights, index = F.softmax(logits, dim=1, dtype=torch.float).topk(self.top_k, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).to(flat.dtype)
            return loop(self, flat, index, weights).reshape(hidden.shape), logits

    class Qwen2MoeBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k, self.norm_topk_prob, self.gate = 2, False, nn.Linear(H, E, bias=False)
            self.experts = nn.ModuleList([MLP() for _ in range(E)])
            self.shared_expert, self.shared_expert_gate = MLP(12), nn.Linear(H, 1, bias=False)

        def forward(self, hidden):
            flat = hidden.reshape(-1, H)
            logits = self.gate(flat)
            weights, index = F.softmax(logits, dim=1, dtype=torch.float).topk(self.top_k, dim=-1)
            out = loop(self, flat, index, weights.to(flat.dtype))
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
            return out.reshape(hidden.shape), logits

    class MoEGate(nn.Module):              # DeepSeek-V2's own: softmax, greedy top-k, scaled
        def __init__(self):
            super().__init__()
            self.top_k, self.routed_scaling_factor, self.norm_topk_prob = 2, 1.5, False
            self.aux_loss_alpha = 0.0
            self.weight = nn.Parameter(torch.randn(E, H) * 0.5)

        def forward(self, flat):
            scores = F.linear(flat.float(), self.weight.float()).softmax(-1)
            weight, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
            # its auxiliary loss (on the tokens it sees) when training with aux_loss_alpha > 0
            aux = self.aux_loss_alpha * scores.mean(0).square().sum() if self.aux_loss_alpha > 0 else None
            return idx, weight * self.routed_scaling_factor, aux

    class DeepseekV2MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.experts = MoEGate(), nn.ModuleList([MLP() for _ in range(E)])
            self.shared_experts = MLP(10)

        def forward(self, hidden):
            flat = hidden.reshape(-1, H)
            idx, weight, _ = self.gate(flat)
            out = loop(self, flat, idx, weight.to(flat.dtype)) + self.shared_experts(flat)
            return out.reshape(hidden.shape)

    class UserMoE(nn.Module):              # a plain model: top-1 by a scoring Linear, sigmoid weight
        def __init__(self):
            super().__init__()
            self.score = nn.Linear(H, E)
            self.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, INTER), nn.GELU(), nn.Linear(INTER, H))
                                          for _ in range(E)])

        def forward(self, hidden):
            index, weights = user_route(self, hidden.reshape(-1, H))
            return loop(self, hidden.reshape(-1, H), index, weights).reshape(hidden.shape)

    def make(cls):
        torch.manual_seed(3)
        return cls()
    return {name: (lambda c=cls: make(c)) for name, cls in
            (("mixtral", MixtralBlock), ("qwen2_moe", Qwen2MoeBlock), ("deepseek_v2", DeepseekV2MoE),
             ("user", UserMoE))}


def user_route(block, flat):
    logits = block.score(flat)
    return logits.argmax(-1, keepdim=True), logits.max(-1, keepdim=True)[0].sigmoid()


def _tokens(rank, step):
    import torch
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(2, 5, H, generator=g)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def train_list_case(rank, world_size, name):
    """Forward (and router logits), gradients, then the loss after one AdamW step, against one
    process on the concatenated batch; non-expert gradients averaged by hand (data parallel)."""
    import torch
    from hyper_parallel import ExpertParallel, get_platform, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    group, platform = mesh.get_group(0), get_platform()
    block, ref = _blocks()[name](), _blocks()[name]()
    ExpertParallel(route=user_route if name == "user" else None).apply(block, mesh)
    per = E // world_size
    assert [len(list(block.experts[i].parameters())) > 0 for i in range(E)] == \
        [rank * per <= i < (rank + 1) * per for i in range(E)]
    # eps 1e-6: Adam turns a gradient of ~1e-9 into a full step whatever its rounding
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (block, ref))
    for step in range(2):
        out = block(_tokens(rank, step))
        ref_outs = [ref(_tokens(r, step)) for r in range(world_size)]
        torch.testing.assert_close(_first(out), _first(ref_outs[rank]), atol=1e-5, rtol=1e-5)
        if isinstance(out, tuple):
            torch.testing.assert_close(out[1], ref_outs[rank][1], atol=1e-6, rtol=1e-6)
        loss = _first(out).square().mean()
        ref_loss = sum(_first(o).square().mean() for o in ref_outs) / world_size
        total = platform.all_reduce(loss.detach().clone(), group, "sum") / world_size
        torch.testing.assert_close(total, ref_loss.detach(), atol=1e-6, rtol=1e-5)
        loss.backward()
        ref_loss.backward()
        ref_named = dict(ref.named_parameters())
        for pname, param in block.named_parameters():
            if ".experts." not in f".{pname}":
                param.grad = platform.all_reduce(param.grad, group, "sum") / world_size
            want = ref_named[pname]
            if want.grad is None:     # an expert no token reached: ours runs on zero rows (zero gradient)
                want.grad = torch.zeros_like(want)
            torch.testing.assert_close(param.grad, want.grad, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=pname: f"{name} grad {n}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return True


def _all_lists(rank, world_size):
    return [train_list_case(rank, world_size, name)
            for name in ("mixtral", "qwen2_moe", "deepseek_v2", "user")]


def test_module_lists_ep2():
    assert run_dist(2, _all_lists, timeout=600) == [[True] * 4] * 2


@pytest.mark.ep_full
def test_module_lists_ep4():
    assert run_dist(4, _all_lists, timeout=600) == [[True] * 4] * 4


def list_errors_case(rank, world_size):
    """Bad input on lists, every rank, before any collective."""
    from hyper_parallel import CommDebugMode, ExpertParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    blocks = _blocks()
    texts = []
    with CommDebugMode() as comm:
        odd = blocks["mixtral"]()
        del odd.experts[7]                                         # 7 experts over 2 ranks
        unlike = blocks["qwen2_moe"]()
        unlike.experts[3].gate_proj = type(unlike.experts[3].gate_proj)(H, 5, bias=False)
        greedy = blocks["mixtral"]()
        greedy.top_k = 9
        aux = blocks["deepseek_v2"]()
        aux.gate.aux_loss_alpha = 0.01
        for make in (lambda: ExpertParallel().apply(odd, mesh),
                     lambda: ExpertParallel().apply(blocks["mixtral"]().experts, mesh),
                     lambda: ExpertParallel().apply(unlike, mesh),
                     lambda: ExpertParallel().apply(greedy, mesh),
                     lambda: ExpertParallel(route=3)):
            with pytest.raises(ValueError) as info:
                make()
            texts.append(str(info.value))
    assert comm.get_total_counts() == 0
    assert "7 experts are not divisible by the ep size 2" in texts[0], texts[0]
    assert "is a per-expert list; apply it to the MoE block" in texts[1], texts[1]
    assert "experts.3 differs from experts.0" in texts[2], texts[2]
    assert "top-k 9 exceeds the 8 experts" in texts[3], texts[3]
    assert "route=3" in texts[4], texts[4]
    ExpertParallel().apply(aux, mesh)
    with pytest.raises(ValueError, match="auxiliary loss computed on this rank's tokens alone"):
        aux(_tokens(rank, 0))
    _model_with_list_and_router_logits(mesh)
    return True


def _model_with_list_and_router_logits(mesh):
    """parallelize_model's check: a model of per-expert lists that asks for router logits is refused
    (the global auxiliary loss reads Hugging Face 5.x routers only), before any collective."""
    from types import SimpleNamespace

    import torch
    from hyper_parallel import CommDebugMode
    from hyper_parallel.integrations.hf_expert_parallel import check_expert_parallel
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_blocks()["mixtral"]()])
    model.config = SimpleNamespace(output_router_logits=True, num_local_experts=E, num_experts_per_tok=2)
    with CommDebugMode() as comm, pytest.raises(ValueError,
                                                match="holds per-expert lists and asks for router"):
        check_expert_parallel(model, mesh, "ep")
    assert comm.get_total_counts() == 0


def list_disagree_case(rank, world_size):
    """Ranks whose routing settings differ: at apply, and when one rank changes one afterwards."""
    from hyper_parallel import ExpertParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    block = _blocks()["qwen2_moe"]()
    block.norm_topk_prob = rank == 1
    with pytest.raises(ValueError, match="disagree on block.norm_topk_prob"):
        ExpertParallel().apply(block, mesh)
    block = ExpertParallel().apply(_blocks()["deepseek_v2"](), mesh)
    block(_tokens(rank, 0))
    # both ranks change it (a rank changing alone meets its peers' next collective: agreement.py)
    block.gate.routed_scaling_factor = 2.0 + rank
    with pytest.raises(ValueError, match=r"disagree on gate.routed_scaling_factor \(rank %d has %s\)"
                       % (rank, 2.0 + rank)):
        block(_tokens(rank, 1))
    return True


def test_list_bad_input_on_every_rank():
    assert run_dist(2, list_errors_case) == [True, True]
    assert run_dist(2, list_disagree_case) == [True, True]
