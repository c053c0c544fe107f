"""hyper_parallel.plan.dry_run of an expert-parallel MoE model against real runs on gloo (2 ranks): a
tiny Qwen3-MoE with ``parallelize_model(ep=...)``. A dry run has no router values and assumes balanced
routing (assignment i to expert i mod E on every rank); the real runs here use a router that routes
exactly so (its scores still come from the router's weights), so the all-to-all splits agree and the
bytes per mesh dim must be equal, the FLOPs equal and the peak memory within 5 %."""
import pytest

from tests.harness import run_dist

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter  # noqa: E402

SEQ, BATCH = 256, 2
# (mesh shape, dim names, ep, cp mode, features)
CASES = [
    ((2,), ("dp_shard",), "dp_shard", None, ("chunked_loss",)),
    ((1, 2), ("dp_shard", "cp"), ("dp_shard", "cp"), "allgather", ()),
]


class BalancedRouter(Qwen3MoeTopKRouter):
    """Qwen3-MoE's router with the dry run's routing assumption made real: token t's choice j goes to
    expert (t·k + j) mod E; the scores are the router's softmax probabilities of those experts."""

    def forward(self, hidden_states):
        import torch
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        tokens = hidden_states.shape[0]
        index = torch.arange(tokens * self.top_k, device=logits.device).remainder(self.num_experts)
        index = index.reshape(tokens, self.top_k)
        scores = probs.gather(1, index)
        if self.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return logits, scores.to(logits.dtype), index


def tiny_moe(dtype="float32"):
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, use_cache=False)
    model = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=dtype)
    for layer in model.model.layers:
        layer.mlp.gate = BalancedRouter(config)   # built where the model is (meta)
    return model


def _summary(report):
    comm = {dim: (c["collectives"], c["bytes_sent"], sorted(c["ops"].items()))
            for dim, c in report.comm.items()}
    return comm, report.peak_memory_bytes, report.flops


def _real(rank, world_size, cases):
    import torch
    from hyper_parallel.plan.dry_run import real_run
    out = []
    for shape, names, ep, mode, features in cases:
        torch.manual_seed(0)
        out.append(_summary(real_run(tiny_moe, shape, names, seq_len=SEQ, batch=BATCH, cp_mode=mode,
                                     features=features, ep=ep)))
    return out


def test_expert_parallel_dry_run_equals_real_run():
    from hyper_parallel.plan import dry_run
    real = run_dist(2, _real, CASES, timeout=300)
    for i, (shape, names, ep, mode, features) in enumerate(CASES):
        for rank in range(2):
            fake = _summary(dry_run(tiny_moe, shape, names, rank=rank, seq_len=SEQ, batch=BATCH, cp_mode=mode,
                                    features=features, ep=ep))
            want, where = real[rank][i], f"{names}={shape} ep={ep} rank {rank}"
            assert fake[0] == want[0], f"{where}: collectives differ\nfake {fake[0]}\nreal {want[0]}"
            # the all-to-alls are there: the count exchange and the tokens out and back, per MoE layer
            ops = dict(fake[0][next(iter(fake[0]))][2]) if len(fake[0]) == 1 else {}
            assert not ops or ops["all_to_all"][0] == 10
            assert fake[2] == want[2], f"{where}: FLOPs {fake[2]} vs {want[2]}"
            assert abs(fake[1] - want[1]) <= 0.05 * want[1], f"{where}: peak {fake[1]} vs real {want[1]}"


def test_expert_parallel_bad_degree_is_named():
    from hyper_parallel.plan import dry_run
    with pytest.raises(ValueError, match="8 experts are not divisible by the ep size 3"):
        dry_run(tiny_moe, (3,), ("dp_shard",), rank=0, seq_len=SEQ, batch=1, ep="dp_shard")


def test_search_offers_expert_parallel_degrees():
    """For a MoE model each mesh is also tried with ep over its data dims whose size divides the experts."""
    from hyper_parallel.plan.search import expert_options, roles
    assert expert_options({"dp_shard": 4, "cp": 1, "tp": 1}, 8) == [None, ("dp_shard",)]
    assert expert_options({"dp_shard": 2, "cp": 2, "tp": 1}, 8) == [None, ("dp_shard",), ("dp_shard", "cp")]
    assert expert_options({"dp_shard": 1, "cp": 4, "tp": 2}, 8) == [None, ("dp_shard", "cp")]
    assert expert_options({"dp_shard": 4, "cp": 1, "tp": 1}, 6) == [None]            # 6 experts, ep 4
    assert expert_options({"dp_replicate": 2, "dp_shard": 2, "cp": 1}, 8) == [None]   # HSDP: no ep
    assert expert_options({"dp_shard": 4, "cp": 1, "tp": 1}, 0) == [None]            # dense
    # rank roles: the last rank; rank 0 too where a split is uneven or the CP mode unbalanced
    assert roles({"dp_shard": 2, "cp": 2}, "zigzag", False) == (3,)
    assert roles({"dp_shard": 2, "cp": 2}, "ring", False) == (3, 0)
    assert roles({"dp_shard": 2, "tp": 2}, None, True) == (3, 0)
