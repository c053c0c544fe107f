"""The ``cpu`` roofline against real runs here (``-m plan_full``; run with ``-s`` to see the table):
three small configurations run for real on 2 gloo ranks (fully_shard, zigzag CP, TP) and are dry-run
and predicted on ``cpu`` calibrated by the same two ranks at the same time (they share the cores as
the real run does). The ratios predicted / measured go to docs/planning.md; no time is asserted
(the machine's load decides them), only that both sides are measured and reported."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")

SEQ = 1024
# (mesh shape, dim names, cp mode, features)
CASES = [
    ((2,), ("dp_shard",), None, ("chunked_loss",)),
    ((1, 2), ("dp_shard", "cp"), "zigzag", ("chunked_loss",)),
    ((2,), ("tp",), None, ("chunked_loss",)),
]


def small_llama(dtype="float32"):
    import transformers
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
                                      max_position_embeddings=SEQ, use_cache=False)
    return transformers.LlamaForCausalLM._from_config(config, dtype=dtype)


def _real(rank, world_size, cases, repeats):
    import torch
    from hyper_parallel.plan.dry_run import real_run, torch_tools
    calibration = torch_tools().calibrate_cpu()     # both ranks at once: the cores as the run shares them
    seconds = []
    for shape, names, mode, features in cases:
        torch.manual_seed(0)
        best = min(real_run(small_llama, shape, names, seq_len=SEQ, cp_mode=mode, features=features)
                   .step_wall_seconds for _ in range(repeats))
        seconds.append(best)
    return calibration, seconds


def measure_ratios(repeats=2):
    """[(case, predicted seconds, measured seconds)] and the calibration used."""
    from hyper_parallel.plan import dry_run
    from hyper_parallel.plan.roofline import predict
    results = run_dist(2, _real, CASES, repeats, timeout=600)
    calibration = results[0][0]
    rows = []
    for i, (shape, names, mode, features) in enumerate(CASES):
        measured = max(r[1][i] for r in results)        # the step ends with the slowest rank
        predicted = max(predict(dry_run(small_llama, shape, names, rank=rank, seq_len=SEQ, cp_mode=mode,
                                        features=features), "cpu", calibration=calibration)["step_seconds"]
                        for rank in range(2))
        rows.append((f"{dict(zip(names, shape))} {mode or ''}", predicted, measured))
    return rows, calibration


@pytest.mark.plan_full
def test_cpu_roofline_against_real_runs():
    rows, calibration = measure_ratios()
    print(f"\ncpu calibration: {calibration['flops'] / 1e9:.1f} GFLOP/s fp32 matmul, "
          f"{calibration['bytes_per_s'] / 1e9:.2f} GB/s memcpy, {1e6 * calibration['op_seconds']:.1f} us "
          f"per small op, {calibration['threads']} threads")
    print(f"{'configuration':40s} {'predicted s':>12s} {'measured s':>11s} {'ratio':>6s}")
    for name, predicted, measured in rows:
        print(f"{name:40s} {predicted:12.3f} {measured:11.3f} {predicted / measured:6.2f}")
    assert all(predicted > 0 and measured > 0 for _, predicted, measured in rows)
