"""Every causal-LM architecture transformers registers, under ``parallelize_model`` context parallelism.

    python -m tests.hf_sweep --ropes --cp4 --write docs/hf_families.md   # the whole sweep, the docs table
    python -m tests.hf_sweep llama opt roberta --modes ulysses     # some types, printed

For each type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny random config (the config class's
defaults shrunk: hidden 32, 2 layers, 4 heads, vocabulary 128, every window / chunk shorter than the
16-token sequence), every ``rope_type`` the config takes, one forward and backward of a 2-row batch
under ``parallelize_model`` on a "cp" mesh, in each CP mode, against the same model in one process:
logits (gathered) and every parameter gradient (summed over ranks) to fp32 1e-5. Verdicts:

- ``exact``: equal (a float32 difference is run again in float64, where it must shrink below 5e-6: rounding
  shrinks with the precision, a defect does not);
- ``refused``: ``parallelize_model`` (or, marked, the first call) raised a ValueError naming the reason;
- ``silent``: it ran and differs (the defect this sweep exists to find);
- ``obscure``: any other error under CP (not a clear refusal);
- ``not text-only`` / ``no tiny config``: the model cannot run on token ids alone in one process, or the
  shrunk config does not build; nothing about context parallelism is learned.

Workers are the test harness's gloo pools (tests/harness); tests/test_hf_sweep.py runs a fast subset.
"""
import argparse
import copy
import sys

from tests.hf_tiny import ROPE_TYPES, VOCAB, WINDOW, rope_types, tiny  # noqa: F401 (this module's API)

B, S = 2, 16
MODES = {"ulysses": {}, "allgather": {"ulysses_degree": 1},
         "allgather-lb": {"ulysses_degree": 1, "load_balance": True},
         "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
         "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True}}


def causal_lm_types():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _wide(logits):
    """float32 logits, or float64 ones as they are (the float64 re-run)."""
    import torch
    return logits if logits.dtype == torch.float64 else logits.float()


def _reference(model, ids, labels):
    """Logits and every parameter gradient of one forward + backward in one process."""
    import torch.nn.functional as F
    logits = _wide(model(input_ids=ids, use_cache=False).logits)
    count = (labels != -100).sum()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


def _batch(vocab):
    import torch
    g = torch.Generator().manual_seed(7)
    # above the special tokens (a pad id inside the batch changes RoBERTa's positions)
    low = min(16, vocab // 2)
    ids = torch.randint(low, vocab, (B, S), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)


def _under_cp(model, ids, labels, mesh):
    import torch
    import torch.nn.functional as F
    from hyper_parallel import get_platform, shard_sequence
    count = (labels != -100).sum()
    local_ids, local_labels = shard_sequence([ids, labels], mesh)
    logits = _wide(model(input_ids=local_ids).logits)
    loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), reduction="sum") / count
    loss.backward()
    group = mesh.get_group()
    every = get_platform().all_gather(logits.detach().contiguous(), group, dim=1)
    grads = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        grads[name] = get_platform().all_reduce(grad.contiguous(), group)
    return every, grads


def _difference(logits, grads, ref_logits, ref_grads):
    """'' when equal to fp32 1e-5, else where and by how much."""
    import torch

    def off(a, b):
        return float((a - b).abs().max()) if a.shape == b.shape else float("inf")
    # float64: 5e-6, as models keep some math in float32 (rotary frequencies under autocast(False), Gemma's
    # buffers: Granite-SWA's longrope logits are 2.5e-6 off in float64 in every CP mode, 1.4e-5 in
    # float32); a defect does not shrink with the precision (a dropped window is 0.07 off in both)
    tol = 5e-6 if logits.dtype == torch.float64 else 1e-5
    if not torch.allclose(logits, ref_logits, atol=tol, rtol=tol):
        return f"logits off by {off(logits, ref_logits):.3g}"
    for name, ref in ref_grads.items():
        ref = torch.zeros_like(grads[name]) if ref is None else ref
        if not torch.allclose(grads[name], ref, atol=tol, rtol=tol):
            return f"grad of {name} off by {off(grads[name], ref):.3g}"
    return ""


def _short(error):
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:600]}"


def run_case(model_type, rope_type, mode, mesh, dtype="float32"):
    """(verdict, detail) of one (type, rope_type, mode) on ``mesh`` (every rank alike). A float32 case
    that differs runs again in float64: equal there, the float32 difference was rounding."""
    verdict, detail = _case(model_type, rope_type, mode, mesh, dtype)
    if verdict != "silent" or dtype != "float32":
        return verdict, detail
    again, detail64 = _case(model_type, rope_type, mode, mesh, "float64")
    if again == "exact":
        return "exact", f"float32 {detail}, float64 equal (rounding)"
    return "silent", f"{detail}; in float64 {detail64}"


def _case(model_type, rope_type, mode, mesh, dtype):
    import warnings

    import torch
    from hyper_parallel.integrations.transformers import parallelize_model
    try:
        config, model_class = tiny(model_type, rope_type)
        if config is None:
            return "skip", f"no rope_type {rope_type}"
        torch.manual_seed(0)
        reference = model_class(config).to(getattr(torch, dtype))
    except Exception as error:
        return "no tiny config", _short(error)
    model = copy.deepcopy(reference)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    ids, labels = _batch(int(text.vocab_size))
    try:
        ref_logits, ref_grads = _reference(reference, ids, labels)
    except Exception as error:
        return "not text-only", _short(error)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            parallelize_model(model, mesh, **MODES[mode.split("@")[0]])   # "zigzag@4": CP 4
        except ValueError as error:
            return "refused", _short(error)
        except Exception as error:
            return "obscure", "at parallelize_model: " + _short(error)
        try:
            logits, grads = _under_cp(model, ids, labels, mesh)
        except ValueError as error:
            return "refused at call", _short(error)
        except Exception as error:
            return "obscure", "at the first call: " + _short(error)
    wrong = _difference(logits, grads, ref_logits, ref_grads)
    return ("silent", wrong) if wrong else ("exact", "")


def sweep_worker(rank, world_size, cases):
    """Every case on this rank of the pool; the verdicts (the same on every rank, else marked)."""
    import transformers
    from hyper_parallel import init_device_mesh
    transformers.logging.set_verbosity_error()
    # a rank that raises alone makes the others fail within a minute, not hang
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=60)
    return [run_case(model_type, rope_type, mode, mesh) for model_type, rope_type, mode in cases]


def _log(cases, results):
    """Append the verdicts to $HP_SWEEP_LOG (a JSON line per case): a long sweep can be merged, resumed."""
    import json
    import os
    path = os.environ.get("HP_SWEEP_LOG")
    if path:
        with open(path, "a") as out:
            for case in cases:
                out.write(json.dumps([list(case), list(results[case])]) + "\n")


def _logged():
    """The cases $HP_SWEEP_LOG already holds (``--resume``)."""
    import json
    import os
    path = os.environ.get("HP_SWEEP_LOG")
    if not path or not os.path.exists(path):
        return set()
    with open(path) as log:
        return {tuple(json.loads(line)[0]) for line in log}


def run_cases(cases, world_size=2, batch=8, timeout=600):
    """{case: (verdict, detail)}; a batch whose pool call fails is re-run one case at a time, and a case
    that fails alone (a hang, a crash, ranks that disagree) is obscure."""
    from tests.harness import DistTestFailure, run_dist
    results = {}
    for start in range(0, len(cases), batch):
        part = cases[start:start + batch]
        try:
            answers = run_dist(world_size, sweep_worker, part, timeout=timeout)
        except DistTestFailure as failure:
            if len(part) == 1:
                results[part[0]] = ("obscure", "ranks failed: " + " ".join(str(failure).split())[:400])
                _log(part, results)
                continue
            results.update(run_cases(part, world_size, 1, timeout))
            continue
        for case, verdicts in zip(part, zip(*answers)):
            same = all(v == verdicts[0] for v in verdicts)
            results[case] = verdicts[0] if same else ("obscure", f"ranks disagree: {verdicts}")
        _log(part, results)
        print(f"  {min(start + batch, len(cases))}/{len(cases)}", file=sys.stderr, flush=True)
    return results


VERDICTS = ("exact", "refused", "refused at call", "silent", "obscure", "not text-only", "no tiny config",
            "not run")


def table(results):
    """The docs table: one row per architecture, its verdict the worst of its context-parallel cases
    (the sweep's own failures, a rope variant whose tiny config does not build, count only for a type
    with no case that ran under CP)."""
    by_type = {}
    for (model_type, rope_type, mode), (verdict, detail) in results.items():
        if verdict != "skip":
            by_type.setdefault(model_type, []).append((rope_type, mode, verdict, detail))
    counts = {v: 0 for v in VERDICTS}
    rows = []
    for model_type in sorted(by_type):
        runs = by_type[model_type]
        under_cp = [r for r in runs if r[2] in ("exact", "refused", "refused at call", "silent", "obscure")]
        worst = max(under_cp or runs, key=lambda r: (r[2] in ("silent", "obscure"), r[2] != "exact"))
        counts[worst[2]] = counts.get(worst[2], 0) + 1
        exact = sum(r[2] == "exact" for r in runs)
        odd = sorted({f"{r[0]}/{r[1]}: {r[2]}" for r in runs if r[2] not in ("exact", worst[2])})
        why = worst[3] if worst[2] != "exact" else ""
        why = "; ".join([why[:300]] + odd[:3]).strip("; ").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {model_type} | {worst[2]} | {exact} of {len(runs)} | {why} |")
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    head = ["| type | verdict | cases exact | reason (first non-exact case; other verdicts by rope / mode) |",
            "|---|---|---|---|"]
    return summary, head + rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal LM)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--ropes", action="store_true", help="every rope_type the config takes")
    parser.add_argument("--rope-modes", default="ulysses,zigzag", help="the CP modes of --ropes")
    parser.add_argument("--cp4", action="store_true", help="also CP 4")
    parser.add_argument("--cp4-modes", default=",".join(MODES), help="the CP modes of --cp4")
    parser.add_argument("--write", help="write the markdown table to this file")
    parser.add_argument("--json", help="also dump every case's verdict to this file")
    parser.add_argument("--from-log", nargs="*", help="tabulate these $HP_SWEEP_LOG files instead of running")
    parser.add_argument("--skip", default="", help="model types to leave out (comma-separated)")
    parser.add_argument("--resume", action="store_true", help="run only the cases $HP_SWEEP_LOG lacks")
    args = parser.parse_args(argv)
    types = [t for t in args.types or causal_lm_types() if t not in args.skip.split(",")]
    modes = args.modes.split(",")
    cases = [(t, "default", m) for t in types for m in modes]
    if args.ropes:
        cases += [(t, r, m) for t in types for r in ROPE_TYPES if r != "default"
                  for m in args.rope_modes.split(",")]
    if args.from_log:
        import json
        results = {}
        for path in args.from_log:
            with open(path) as log:
                results.update((tuple(c), tuple(v)) for c, v in map(json.loads, log))
        missing = sorted(set(types) - {case[0] for case in results})
        results.update(((t, "default", "-"), ("not run", "not reached in this sweep")) for t in missing)
    else:
        done = _logged() if args.resume else set()
        results = run_cases([c for c in cases if c not in done])
    if args.cp4 and not args.from_log:
        done = _logged() if args.resume else set()
        cp4 = [(t, "default", m + "@4") for t in types for m in args.cp4_modes.split(",")]
        results.update(run_cases([c for c in cp4 if c not in done], world_size=4))
    if args.json:
        import json
        with open(args.json, "w") as out:
            json.dump([[list(case), list(verdict)] for case, verdict in results.items()], out, indent=0)
    summary, lines = table(results)
    for case, (verdict, detail) in sorted(results.items()):
        if verdict not in ("exact", "skip"):
            print(case, verdict, detail[:300])
    print(summary)
    if args.write:
        with open(args.write, "w") as out:
            given = argv if argv is not None else sys.argv[1:]
            command = " ".join(a for a in given if "jsonl" not in a and a not in ("--from-log", "--write")
                               and not a.endswith(".md"))
            command = f"`python -m tests.hf_sweep {command}`"
            command += " (tabulated from its `HP_SWEEP_LOG` with `--from-log`)" if args.from_log else ""
            out.write(_DOC_HEAD.format(summary=summary, modes=", ".join(modes), command=command)
                      + "\n".join(lines) + "\n")


_DOC_HEAD = """# Hugging Face causal LMs under context parallelism

Generated by {command} (tests/hf_sweep.py, tests/hf_tiny.py): every type in
transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, a tiny random config (the config class's defaults
shrunk with their dependent sizes: hidden 32, 4 heads, vocabulary 128, one layer of each layer kind,
every sliding window and chunk 5 on a 16-token sequence, dropout 0), one forward + backward of a 2-row
batch under `parallelize_model` against one process: logits and every parameter gradient to fp32 1e-5
(a float32 difference is run again in float64, where it must shrink below 5e-6: rounding, not a
defect). Cases per type: CP 2 in the modes {modes}; with `--ropes`, every rope type the config takes
in `--rope-modes` (ulysses, zigzag); with `--cp4`, CP 4 in every mode.

Verdicts: **exact**; **refused** (a ValueError naming the reason at `parallelize_model`, or
*at call*: at the first forward); **silent** (ran and differs: a defect); **obscure** (another error: a
defect); **not text-only** (the model does not run on token ids alone in one process); **no tiny
config** (the shrunk config does not build: the sweep's shrinking, not context parallelism, fails);
**not run**.

Summary (worst verdict per architecture): {summary}.

"""


if __name__ == "__main__":
    main()
