"""hyper_parallel.plan.dry_run against real runs: the same training step of a tiny Llama / Qwen3 on 2
and 4 gloo ranks (TP, CP ulysses / allgather / ring / zigzag, fully_shard, chunked loss), then every
rank of the same job dry-run in this process on fake tensors and the fake process group. Per rank
and per mesh dim the collectives and bytes must be equal, the peak memory within 5 %. The default run
takes one 4-rank case; ``-m plan_full`` the others."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

# (mesh shape, dim names, cp mode, features, family)
CASES_2 = [
    ((2,), ("tp",), None, ("chunked_loss",), "llama"),
    ((1, 2), ("dp_shard", "cp"), "ulysses", (), "llama"),
    ((1, 2), ("dp_shard", "cp"), "allgather", ("chunked_loss",), "qwen3"),
    ((1, 2), ("dp_shard", "cp"), "ring", (), "llama"),
    ((2,), ("dp_shard",), None, ("chunked_loss",), "llama"),
    # fp32 master weights, bf16 gathered parameters and compute, gradients reduced in fp32
    ((1, 2), ("dp_shard", "cp"), "zigzag", ("chunked_loss",), "llama",
     {"param_dtype": "bfloat16", "reduce_dtype": "float32"}),
]
CASES_4 = [
    ((2, 2), ("dp_shard", "cp"), "zigzag", ("chunked_loss",), "llama"),
    ((1, 2, 2), ("dp_shard", "cp", "tp"), "ulysses", (), "qwen3"),
    ((2, 2), ("dp_shard", "tp"), None, ("chunked_loss", "tiled_mlp"), "llama"),
]
SEQ, BATCH = 256, 2


def tiny_model(family="llama", dtype="float32"):
    import transformers
    cls, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                  "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    config = getattr(transformers, cls)(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                        head_dim=16, max_position_embeddings=256, use_cache=False)
    return getattr(transformers, model)._from_config(config, dtype=dtype)


def _summary(report):
    comm = {dim: (c["collectives"], c["bytes_sent"], sorted(c["ops"].items()))
            for dim, c in report.comm.items()}
    return comm, report.peak_memory_bytes, report.memory_bytes, report.flops


def _real_cases(rank, world_size, cases):
    import functools
    import torch
    from hyper_parallel.plan.dry_run import real_run
    out = []
    for shape, names, mode, features, family, *options in cases:
        torch.manual_seed(0)
        report = real_run(functools.partial(tiny_model, family), shape, names, seq_len=SEQ, batch=BATCH,
                          cp_mode=mode, features=features, **(options[0] if options else {}))
        out.append(_summary(report))
    return out


def _check(world_size, cases):
    import functools
    from hyper_parallel.plan import dry_run
    real = run_dist(world_size, _real_cases, cases, timeout=300)
    for i, (shape, names, mode, features, family, *options) in enumerate(cases):
        for rank in range(world_size):
            fake = _summary(dry_run(functools.partial(tiny_model, family), shape, names, rank=rank,
                                    seq_len=SEQ, batch=BATCH, cp_mode=mode, features=features,
                                    **(options[0] if options else {})))
            want = real[rank][i]
            where = f"{names}={shape} {mode} {features} rank {rank}"
            assert fake[0] == want[0], f"{where}: collectives differ\nfake {fake[0]}\nreal {want[0]}"
            assert fake[3] == want[3], f"{where}: FLOPs {fake[3]} vs {want[3]}"
            assert abs(fake[1] - want[1]) <= 0.05 * want[1], f"{where}: peak {fake[1]} vs real {want[1]}"


def test_dry_run_equals_real_run_2_ranks():
    _check(2, CASES_2[:-1])


def test_dry_run_mixed_precision_equals_real_run():
    """fully_shard's MixedPrecisionPolicy (the dry run's param_dtype= / reduce_dtype=) on gloo."""
    _check(2, CASES_2[-1:])


def test_dry_run_equals_real_run_4_ranks():
    _check(4, CASES_4[:1])


@pytest.mark.plan_full
def test_dry_run_equals_real_run_4_ranks_full():
    _check(4, CASES_4[1:])
