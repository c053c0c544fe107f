"""ContextParallel's own overhead: ``python -m benchmarks.cp_overhead --seq 512 --nproc 2``.

``benchmarks.cp_attention`` times each mode after the other, so on a shared machine its framework
and raw rows can see different loads. This script times a mode through ``ContextParallel`` and its
raw form (``benchmarks.cp_modes``: the same algorithm written with the platform's differentiable
collectives only) interleaved round by round on the same inputs, and prints the medians and the
ratio framework / raw, forward (no grad) and forward + backward. For Ulysses a second raw form,
q, k, v in one hand-packed all-to-all (as ContextParallel moves them), is timed in the same rounds
and its ratio printed too. Torch, spawned gloo CPU ranks.
``--json PATH`` writes the numbers.
"""
import argparse
import json
import statistics
import sys
import os
import time

if __package__ in (None, ""):   # run as a file (msrun benchmarks/x.py): the package is at the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.cp_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    p.add_argument("--seq", type=int, default=512, help="global sequence length (default 512)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--mode", default="ulysses", help="a mode with a raw form in benchmarks.cp_modes")
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--peers", action="store_true",
                   help="time the peers of the mode in the same rounds (ulysses: DeepSpeed's DistributedAttention "
                        "and PyTorch DTensor, where importable)")
    args = p.parse_args(argv)
    for name in ("nproc", "seq", "heads", "head_dim", "rounds"):
        if getattr(args, name) < 1:
            p.exit(2, f"cp_overhead: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}\n")
    if args.seq % args.nproc:
        p.exit(2, f"cp_overhead: --seq {args.seq} is not divisible by --nproc {args.nproc}\n")
    return args


class _Config:
    def __init__(self, args):
        self.batch, self.seq, self.heads, self.kv_heads = 1, args.seq, args.heads, args.heads
        self.head_dim, self.causal = args.head_dim, True


def _builds(args, mesh, fw):
    from benchmarks.cp_modes import MODES, RAW_FUSED
    modes = {m.name: m for m in MODES}
    names = (args.mode, f"{args.mode} (raw)")
    missing = [n for n in names if n not in modes]
    if missing:
        raise SystemExit(f"cp_overhead: no mode {missing[0]!r}; modes with a raw form: "
                         f"{sorted(n[:-6] for n in modes if n.endswith(' (raw)'))}")
    cfg = _Config(args)
    why = modes[args.mode].supported(cfg, mesh.size(), fw)
    if why:
        raise SystemExit(f"cp_overhead: {args.mode} cannot run here: {why}")
    fns = {"framework": modes[names[0]].build(cfg, mesh, fw), "raw": modes[names[1]].build(cfg, mesh, fw)}
    if args.mode in RAW_FUSED:   # ContextParallel fuses q, k, v into one collective: time that by hand too
        fns["raw_fused"] = RAW_FUSED[args.mode](cfg, mesh, fw)
    if args.peers:
        from benchmarks.cp_peers import available_peers
        for peer in available_peers(cfg):
            if peer.formula_as == args.mode and not peer.forward_only:
                fns[peer.name] = peer.build(cfg, mesh)
    return fns


def _timed(torch, fns, blocks, grad_out, rounds):
    """Median ms of forward (no grad) and forward + backward per candidate, interleaved."""
    def forward(fn):
        with torch.no_grad():
            fn(*blocks)

    def forward_backward(fn):
        fn(*blocks).backward(grad_out)
        for t in blocks:
            t.grad = None
    samples = {name: ([], []) for name in fns}
    for i in range(rounds + 3):   # three warm-up rounds
        for name, fn in fns.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            forward(fn)
            middle = time.perf_counter()
            forward_backward(fn)
            end = time.perf_counter()
            if i >= 3:
                samples[name][0].append((middle - start) * 1e3)
                samples[name][1].append((end - middle) * 1e3)
    return {name: {"fwd_ms": statistics.median(f), "fwd_bwd_ms": statistics.median(fb)}
            for name, (f, fb) in samples.items()}


def run_rank(args):
    import torch
    from benchmarks.cp_frameworks import framework_ops
    from hyper_parallel import init_device_mesh
    from hyper_parallel.platform import get_platform
    torch.set_num_threads(1)
    platform = get_platform()
    platform.init_process_group()
    rank, world = platform.get_rank(), platform.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    fns = _builds(args, mesh, framework_ops(platform, "float32"))
    g = torch.Generator().manual_seed(0)
    length = args.seq // world
    full = [torch.randn(1, args.seq, args.heads, args.head_dim, generator=g) for _ in range(3)]
    blocks = [t[:, rank * length:(rank + 1) * length].clone().requires_grad_() for t in full]
    grad_out = torch.randn(1, length, args.heads, args.head_dim, generator=g)
    result = _timed(torch, fns, blocks, grad_out, args.rounds)
    if rank == 0:
        _report(args, world, result)
    platform.destroy_process_group()


def _report(args, world, result):
    ours = result["framework"]
    fused = result.pop("raw_fused", None)
    peers = {name: result.pop(name) for name in list(result) if name not in ("framework", "raw")}
    ratios = {key: ours[key] / result["raw"][key] for key in ("fwd_ms", "fwd_bwd_ms")}
    print(f"{args.mode} at S={args.seq}, world {world}, interleaved medians of {args.rounds} rounds")
    print(f"{'':<34}{'fwd ms':>10}{'fwd+bwd ms':>12}")
    rows = [("ContextParallel", ours), ("raw collectives", result["raw"])]
    if fused is not None:
        rows.append(("raw, q/k/v in one all-to-all", fused))
    for name, row in rows:
        print(f"{name:<34}{row['fwd_ms']:>10.2f}{row['fwd_bwd_ms']:>12.2f}")
    print(f"{'ratio':<34}{ratios['fwd_ms']:>10.2f}{ratios['fwd_bwd_ms']:>12.2f}")
    data = {"result": result, "ratio": ratios, "args": vars(args), "world": world}
    if fused is not None:
        data["raw_fused"] = fused
        data["ratio_to_raw_fused"] = {key: ours[key] / fused[key] for key in ("fwd_ms", "fwd_bwd_ms")}
        print(f"{'ratio to raw, one all-to-all':<34}{data['ratio_to_raw_fused']['fwd_ms']:>10.2f}"
              f"{data['ratio_to_raw_fused']['fwd_bwd_ms']:>12.2f}")
    for name, row in peers.items():
        ratio = {key: ours[key] / row[key] for key in ("fwd_ms", "fwd_bwd_ms")}
        data.setdefault("peers", {})[name] = {**row, "ratio": ratio}
        print(f"{name:<34}{row['fwd_ms']:>10.2f}{row['fwd_bwd_ms']:>12.2f}")
        print(f"{'ratio to ' + name:<34}{ratio['fwd_ms']:>10.2f}{ratio['fwd_bwd_ms']:>12.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)


def main(argv=None):
    from benchmarks.cp_launch import run_or_spawn
    return run_or_spawn(run_rank, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
