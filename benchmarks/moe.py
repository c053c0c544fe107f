"""Expert parallelism against replicated experts: ``python -m benchmarks.moe`` (SPEC §17).

Spawns ``--nproc`` local CPU ranks (gloo) unless launched by torchrun (default: 2 then 4 ranks, one
process group each). One MoE network (benchmarks/moe_model.py: replicated router, stacked SwiGLU
experts in the Hugging Face layout) is trained on the same batches three ways:
hyper_parallel.ExpertParallel (experts split over the ranks, the rest under fully_shard),
data_parallel and fully_shard with every expert on every rank (fully_shard gathers a block's whole
expert set). It prints and writes as JSON, per rank:

* the expert bytes each rank holds beside total / ep (SPEC §17: = total / ep);
* the bytes the dispatch sends in one step (its all-to-alls, counted by CommDebugMode) beside the
  closed form from the routing counts: per MoE layer, forward ``(E+ep)·8·(ep−1)/ep`` (the count
  exchange, with the index-range flags) ``+ (rows to other ranks' experts + rows returned to other
  ranks)·H·4``, and backward the same rows again (the reverse exchanges);
* token imbalance: per layer, max / mean of the rows each rank's experts receive;
* step time (forward + backward + fused AdamW), the setups interleaved round by round, medians and
  ratios (this machine is shared and noisy: only ratios measured in one run mean anything).

torchtitan 0.3's expert parallelism (``torchtitan.models.common.token_dispatcher``) is tried on the
same shapes; where it cannot run here its reason is reported (the JSON's ``torchtitan`` entry).
"""
import argparse
import json
import os
import sys

if __package__ in (None, ""):   # run as a file: the package is at the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rank_common import (finish, interleaved_rounds, median_over_ranks, medians,  # noqa: E402
                                    write_json)

EP = "hyper_parallel.ExpertParallel"
DP = "hyper_parallel.data_parallel (replicated experts)"
FS = "hyper_parallel.fully_shard (replicated experts)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="local ranks (default: 2, then 4)")
    p.add_argument("--layers", type=int, default=2, help="MoE blocks (default 2)")
    p.add_argument("--hidden", type=int, default=128, help="model width (default 128)")
    p.add_argument("--experts", type=int, default=16, help="experts per block (default 16)")
    p.add_argument("--inter", type=int, default=256, help="expert intermediate size (default 256)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank and step (default 256)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved timing rounds (default 6)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    for name in ("layers", "hidden", "experts", "inter", "top_k", "tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.nproc is not None and (args.nproc < 1 or args.experts % args.nproc):
        p.error(f"--nproc {args.nproc} must divide --experts {args.experts}")
    return args


def _net(torch, args):
    from benchmarks.moe_model import build
    return build(torch, args.hidden, args.experts, args.inter, args.top_k, args.layers)


def _setups(torch, args, mesh):
    from hyper_parallel import ExpertParallel, data_parallel, fully_shard
    ep = _net(torch, args)
    for block in ep.blocks:
        ExpertParallel().apply(block.experts, mesh)
        fully_shard(block, mesh)     # router and norm; the experts keep their ep split
    fully_shard(ep, mesh)
    fs = _net(torch, args)
    for block in fs.blocks:
        fully_shard(block, mesh)
    fully_shard(fs, mesh)
    return {EP: ep, DP: data_parallel(_net(torch, args), mesh), FS: fs}


def _step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def closed_form(counts, rank, n, hidden, itemsize=4):
    """Bytes rank ``rank`` sends in one step's dispatch, from ``counts[s][layer][e]`` (every rank's
    top-k assignments per expert): see the module docstring."""
    total = 0
    for layer in range(len(counts[0])):
        experts = len(counts[0][layer])
        local = experts // n
        mine = range(rank * local, (rank + 1) * local)
        away = sum(c for e, c in enumerate(counts[rank][layer]) if e not in mine)
        back = sum(counts[s][layer][e] for s in range(n) if s != rank for e in mine)
        total += (experts + n) * 8 * (n - 1) // n + 2 * (away + back) * hidden * itemsize
    return total


def imbalance(counts, n):
    """Per layer: max / mean of the rows each rank's experts receive."""
    out = []
    for layer in range(len(counts[0])):
        experts = len(counts[0][layer])
        local = experts // n
        rows = [sum(counts[s][layer][e] for s in range(n) for e in range(r * local, (r + 1) * local))
                for r in range(n)]
        out.append(max(rows) / (sum(rows) / n))
    return out


def _measure_dispatch(torch, args, model, opt, x):
    from benchmarks.moe_model import RoutingRecorder
    from hyper_parallel import CommDebugMode
    recorder = RoutingRecorder(torch, model, args.experts)
    with CommDebugMode() as comm:
        _step(model, opt, x)
    recorder.remove()
    dispatch = [b for op, b, _ in comm.log if op == "all_to_all"]
    return recorder.counts, {"bytes": sum(dispatch), "calls": len(dispatch), "all": comm.get_comm_counts()}


def run_rank(args):
    import torch
    from benchmarks.moe_model import expert_bytes
    from benchmarks.moe_titan import try_torchtitan
    from hyper_parallel import init_device_mesh
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.nproc,), mesh_dim_names=("ep",))
    rank, n = torch.distributed.get_rank(), args.nproc
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
    setups = _setups(torch, args, mesh)
    runs = {k: (m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)) for k, m in setups.items()}
    for model, opt in runs.values():
        _step(model, opt, x)     # warm-up: optimizer state exists, the settings check is done
    counts, dispatch = _measure_dispatch(torch, args, *runs[EP], x)
    every = [None] * n
    torch.distributed.all_gather_object(every, counts)
    times, _ = interleaved_rounds(torch, list(runs), lambda name: _step(*runs[name], x), args.rounds)
    result = {
        "rank": rank, "expert_bytes": expert_bytes(runs[EP][0]),
        "expert_bytes_total": expert_bytes(runs[DP][0]),
        "dispatch_bytes_step": dispatch["bytes"], "dispatch_all_to_alls": dispatch["calls"],
        "comm_counts_step": dispatch["all"], "closed_form_bytes": closed_form(every, rank, n, args.hidden),
        "imbalance_per_layer": imbalance(every, n), "routing_counts": counts,
        "step_ms": medians(times),
        "torchtitan": try_torchtitan(torch, args, mesh, x),
    }
    finish(torch, args, result, _report)


def _report(args, results):
    n = args.nproc
    print(f"{n} ranks (ep {n}), {args.layers} MoE blocks, {args.experts} experts of "
          f"{args.hidden}x{args.inter}, top-{args.top_k}, {args.tokens} tokens per rank")
    print(f"{'rank':<6}{'expert B':>12}{'total / ep':>12}{'ratio':>8}{'dispatch B/step':>17}"
          f"{'closed form':>13}{'a2a calls':>11}{'imbalance':>11}")
    for r in results:
        per = r["expert_bytes_total"] / n
        print(f"{r['rank']:<6}{r['expert_bytes']:>12,d}{per:>12,.0f}{r['expert_bytes'] / per:>8.3f}"
              f"{r['dispatch_bytes_step']:>17,d}{r['closed_form_bytes']:>13,d}"
              f"{r['dispatch_all_to_alls']:>11d}"
              f"{max(r['imbalance_per_layer']):>11.3f}")
    med = median_over_ranks(results)
    print("step time (median over ranks of each rank's median, interleaved rounds):")
    for name, ms in med.items():
        print(f"  {name:<52}{ms:>9.2f} ms   ExpertParallel / this = {med[EP] / ms:.2f}")
    print(f"  torchtitan: {results[0]['torchtitan']}")
    if args.json:
        write_json(args.json, {"args": vars(args), "ranks": results, "step_ms": med})
    return med


def main(argv=None):
    from benchmarks.cp_launch import run_or_spawn
    args = parse_args(argv)
    if args.nproc is not None or "RANK" in os.environ:
        return run_or_spawn(run_rank, args)
    json_path, status, parts = args.json, 0, {}
    for nproc in (2, 4):     # each degree in its own process group
        args.nproc, args.json = nproc, (f"{json_path}.ep{nproc}" if json_path else None)
        status = status or run_or_spawn(run_rank, args)
        if json_path:
            with open(args.json, encoding="utf-8") as f:
                parts[f"ep{nproc}"] = json.load(f)
            os.remove(args.json)
    if json_path:
        write_json(json_path, parts)
    return status


if __name__ == "__main__":
    sys.exit(main())
