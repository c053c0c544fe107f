"""Compiled against eager training steps of a TP Llama stack: ``python -m benchmarks.compile_step``.

Spawns ``--nproc`` local CPU ranks (gloo) unless launched by torchrun. The same stack of Llama
blocks (RMSNorm, causal attention, SwiGLU MLP; TP plan with sequence parallelism unless --no-sp) is
parallelized twice; in one copy each block is compiled (``compile_module``: the block's DTensor
dispatch and collectives in one graph, docs/compile.md). After two warm-up steps (the first runs
eagerly, the second compiles; not timed, their time is reported apart) both train on the same
batches, interleaved round by round: forward + backward + AdamW. It prints, per rank and as medians:
step time eager, step time compiled, and eager / compiled (> 1: compiled is faster); and the largest
loss difference of the two (they must agree to fp32 rounding). ``--json PATH`` writes the numbers.
This machine is shared and noisy: only ratios measured within one run mean anything.
"""
import argparse
import copy
import os
import sys
import time

if __package__ in (None, ""):   # run as a file: the package is at the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rank_common import (finish, interleaved_rounds, median_over_ranks, medians,  # noqa: E402
                                    write_json)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="tensor-parallel ranks to spawn (default 2)")
    p.add_argument("--layers", type=int, default=2, help="Llama blocks (default 2)")
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds (default 8)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    for name in ("nproc", "layers", "dim", "heads", "seq", "batch", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.nproc or args.dim % args.heads or args.seq % args.nproc:
        p.error("--heads and --seq must be divisible by --nproc, --dim by --heads")
    return args


def _stack(args):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    hd = args.dim // args.heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(args.dim), nn.RMSNorm(args.dim)
            self.attention = nn.ModuleDict({n: nn.Linear(args.dim, args.dim, bias=False)
                                            for n in "qkvo"})
            self.feed_forward = nn.ModuleDict({"w1": nn.Linear(args.dim, 4 * args.dim, bias=False),
                                               "w3": nn.Linear(args.dim, 4 * args.dim, bias=False),
                                               "w2": nn.Linear(4 * args.dim, args.dim, bias=False)})

        def _attend(self, x):
            a = self.attention
            b, s, _ = x.shape
            q, k, v = (a[n](x).view(b, s, -1, hd).transpose(1, 2) for n in "qkv")
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return a["o"](o.transpose(1, 2).reshape(b, s, -1))

        def forward(self, x):
            h = x + self._attend(self.attention_norm(x))
            f = self.feed_forward
            y = self.ffn_norm(h)
            return h + f["w2"](F.silu(f["w1"](y)) * f["w3"](y))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(args.layers)])


def _plan(sp):
    from hyper_parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
    from hyper_parallel.core.dtensor import Replicate, Shard
    seq = Shard(1) if sp else Replicate()
    plan = {"*.attention.[qkv]": ColwiseParallel(), "*.attention.o": RowwiseParallel(output_layouts=seq),
            "*.feed_forward.w[13]": ColwiseParallel(),
            "*.feed_forward.w2": RowwiseParallel(output_layouts=seq)}
    if sp:
        plan.update({"*.attention_norm": SequenceParallel(), "*.ffn_norm": SequenceParallel(),
                     "*.attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                       desired_input_layouts=(Replicate(),)),
                     "*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                          desired_input_layouts=(Replicate(),))})
    return plan


def run_rank(args):
    import torch
    from hyper_parallel import init_device_mesh, parallelize_module
    from hyper_parallel.platform.torch.compile_support import compile_module
    torch.set_num_threads(1)
    n, rank = args.nproc, int(os.environ["RANK"])
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    sp = not args.no_sp
    ref = _stack(args)
    models = {"eager": parallelize_module(copy.deepcopy(ref), mesh, _plan(sp)),
              "compiled": parallelize_module(copy.deepcopy(ref), mesh, _plan(sp))}
    for block in models["compiled"]:
        compile_module(block, backend=args.backend)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for k, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.dim, generator=gen)
    x = x.chunk(n, 1)[rank] if sp else x

    def step(name):
        opts[name].zero_grad()
        loss = models[name](x).pow(2).mean()
        loss.backward()
        opts[name].step()
        return float(loss)
    first = {}
    for name in models:   # warm-up: two steps (a block's first call of a signature runs eagerly, the
        torch.distributed.barrier()   # second compiles: docs/compile.md); the AdamW state exists afterwards
        start = time.perf_counter()
        step(name)
        first[name] = step(name)
        first[name + "_s"] = time.perf_counter() - start
    times, losses = interleaved_rounds(torch, list(models), step, args.rounds)
    diff = max([abs(first["eager"] - first["compiled"])]
               + [abs(e - c) for e, c in zip(losses["eager"], losses["compiled"])])
    result = {"rank": rank, "step_ms": medians(times),
              "first_step_s": {k: first[k + "_s"] for k in models}, "max_loss_diff": diff}
    finish(torch, args, result, _report)


def _report(args, results):
    print(f"{args.nproc} TP ranks{'' if args.no_sp else ' + SP'}, {args.layers} Llama blocks, "
          f"dim {args.dim}, seq {args.seq}, batch {args.batch}, backend {args.backend}")
    print(f"{'rank':<6}{'eager ms':>10}{'compiled ms':>13}{'eager/compiled':>16}{'warm-up s (e / c)':>24}")
    for r in results:
        ms = r["step_ms"]
        print(f"{r['rank']:<6}{ms['eager']:>10.2f}{ms['compiled']:>13.2f}"
              f"{ms['eager'] / ms['compiled']:>16.2f}"
              f"{r['first_step_s']['eager']:>12.1f} / {r['first_step_s']['compiled']:.1f}")
    med = median_over_ranks(results, ("eager", "compiled"))
    speedup = med["eager"] / med["compiled"]
    diff = max(r["max_loss_diff"] for r in results)
    print(f"median step: eager {med['eager']:.2f} ms, compiled {med['compiled']:.2f} ms, "
          f"eager / compiled = {speedup:.2f}; largest loss difference {diff:.2e}")
    if args.json:
        write_json(args.json, {"args": vars(args), "ranks": results, "step_ms": med,
                               "eager_over_compiled": speedup, "max_loss_diff": diff})


def main(argv=None):
    from benchmarks.cp_launch import run_or_spawn
    return run_or_spawn(run_rank, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
