"""The cost of DTensor dispatch itself: ``python -m benchmarks.dtensor_dispatch``.

Spawns ``--nproc`` local CPU ranks (gloo) unless launched by torchrun. For each op of a chain of
small layout-preserving calls on a ``Shard(0)`` DTensor, it times one call with hyper_parallel,
with PyTorch DTensor and on plain tensors, interleaved round by round (this machine is noisy: only
ratios measured in one run mean anything), and prints µs per op and the ratios. Then one Llama-style
block (attention projections and SwiGLU MLP, the same tensor-parallel plan for both libraries)
forward + backward + SGD step, end to end. ``--json PATH`` writes the numbers.

The calls repeat, so hyper_parallel serves them from its dispatch fast path after the first
(core/dtensor/dispatch/fast_path.py: local op -> wrap). The last op row repeats the chain on inputs that
require grad, where both libraries also build autograd nodes.
"""
import argparse
import json
import statistics
import os
import sys
import time

if __package__ in (None, ""):   # run as a file (msrun benchmarks/x.py): the package is at the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds (default 30)")
    p.add_argument("--calls", type=int, default=20, help="calls per round and library (default 20)")
    p.add_argument("--dim", type=int, default=64, help="model width of the block (default 64)")
    p.add_argument("--seq", type=int, default=16, help="tokens in the block's batch (default 16)")
    p.add_argument("--repeat", type=int, default=1,
                   help="time the op table this many times in the same run and print the spread of "
                        "each ratio (default 1)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: this thread's CPU time (default; a shared machine's preemptions are not the "
                        "library's cost); wall: elapsed time")
    args = p.parse_args(argv)
    for name in ("nproc", "rounds", "calls", "dim", "seq", "repeat"):
        if getattr(args, name) < 1:
            p.exit(2, f"dtensor_dispatch: --{name} must be >= 1, got {getattr(args, name)}\n")
    return args


def _ops(torch):
    """name -> fn(x, w): small layout-preserving ops (x: (rows, 32), w: (32, 32) replicated)."""
    return {
        "add (x + x)": lambda x, w: x + x,
        "matmul (x @ w)": lambda x, w: x @ w,
        "relu": lambda x, w: torch.relu(x),
        "mul by scalar": lambda x, w: x * 2.0,
        "chain (x + x) @ w, relu, * 2": lambda x, w: torch.relu((x + x) @ w) * 2.0,
    }


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]


def _interleaved(candidates, rounds, calls, sync):
    """Median µs per call of each candidate, timed round by round in turn."""
    samples = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            sync()
            start = _clock()
            for _ in range(calls):
                fn()
            sync()
            samples[name].append((_clock() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def _op_inputs(torch, tdt):
    """x (rows, 32) Shard(0) and w (32, 32) replicated for each library and as plain tensors,
    without and with requires_grad; built once, so repeated tables time the same objects."""
    import hyper_parallel as hpl
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    hp_mesh = hpl.init_device_mesh("cpu", (world,))
    t_mesh = tdt.init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64 * world, 32, generator=g), torch.randn(32, 32, generator=g)
    plain = {"hyper_parallel": (hpl.distribute_tensor(x, hp_mesh, [hpl.Shard(0)]),
                                hpl.distribute_tensor(w, hp_mesh, [hpl.Replicate()])),
             "torch DTensor": (tdt.distribute_tensor(x, t_mesh, [tdt.Shard(0)]),
                               tdt.distribute_tensor(w, t_mesh, [tdt.Replicate()])),
             "plain": (x.chunk(world)[rank].clone(), w)}
    grad = {k: tuple(t.detach().requires_grad_() for t in v) for k, v in plain.items()}
    return plain, grad


def _op_table(args, torch, inputs):
    plain, grad = inputs
    rows = {}
    for name, fn in _ops(torch).items():
        rows[name] = _interleaved({k: (lambda fn=fn, a=a: fn(*a)) for k, a in plain.items()},
                                  args.rounds, args.calls, lambda: None)
    # the same chain on inputs that require grad (forward only): autograd nodes are part of the cost
    chain = _ops(torch)["chain (x + x) @ w, relu, * 2"]
    rows["chain, inputs requiring grad"] = _interleaved(
        {k: (lambda a=a: chain(*a)) for k, a in grad.items()}, args.rounds, args.calls, lambda: None)
    return rows


def _block(torch, dim):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
            self.w1, self.w3 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
            self.w2 = nn.Linear(4 * dim, dim, bias=False)

        def forward(self, x):
            heads = 4
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, -1, dim // heads).transpose(1, 2)
                       for p in (self.wq, self.wk, self.wv))
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
            return x + self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))
    return Block


def _block_step(args, torch, tdt):
    import hyper_parallel as hpl
    from torch.distributed.tensor import parallel as tp
    world = torch.distributed.get_world_size()
    plan_names = {"wq": "col", "wk": "col", "wv": "col", "wo": "row", "w1": "col", "w3": "col", "w2": "row"}
    torch.manual_seed(0)
    Block = _block(torch, args.dim)
    ours, theirs = Block(), Block()
    theirs.load_state_dict(ours.state_dict())
    hpl.parallelize_module(ours, hpl.init_device_mesh("cpu", (world,)), {
        k: hpl.ColwiseParallel() if v == "col" else hpl.RowwiseParallel() for k, v in plan_names.items()})
    tp.parallelize_module(theirs, tdt.init_device_mesh("cpu", (world,)), {
        k: tp.ColwiseParallel() if v == "col" else tp.RowwiseParallel() for k, v in plan_names.items()})
    x = torch.randn(2, args.seq, args.dim, generator=torch.Generator().manual_seed(1))

    def step(model):
        def run():
            model(x).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 1e-3 * p.grad
                    p.grad = None
        return run
    return _interleaved({"hyper_parallel": step(ours), "torch DTensor": step(theirs)},
                        max(3, args.rounds // 3), 3, lambda: None)


def run_rank(args):
    global _clock
    _clock = CLOCKS[args.clock]
    import torch
    import torch.distributed.tensor as tdt
    torch.set_num_threads(1)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    inputs = _op_inputs(torch, tdt)
    tables = [_op_table(args, torch, inputs) for _ in range(args.repeat)]
    block = _block_step(args, torch, tdt)
    if torch.distributed.get_rank() == 0:
        _report(args, tables, block)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _report(args, tables, block):
    """The last table in full; with --repeat, each ratio's spread over all tables."""
    rows = tables[-1]
    print(f"clock: {args.clock} ({'CPU time of the timing thread' if args.clock == 'cpu' else 'elapsed'})")
    spread = len(tables) > 1
    print(f"{'op (µs per call)':<34}{'hyper_parallel':>15}{'torch DTensor':>15}{'plain':>9}"
          f"{'hp / torch':>12}" + (f"{'spread':>14}" if spread else ""))
    print("-" * (99 if spread else 85))
    for name, t in rows.items():
        ratios = [tab[name]['hyper_parallel'] / tab[name]['torch DTensor'] for tab in tables]
        print(f"{name:<34}{t['hyper_parallel']:>15.1f}{t['torch DTensor']:>15.1f}{t['plain']:>9.1f}"
              f"{ratios[-1]:>12.2f}" + (f"{min(ratios):>8.2f}-{max(ratios):.2f}" if spread else ""))
    ours, theirs = block["hyper_parallel"], block["torch DTensor"]
    print(f"\nTP block fwd+bwd+SGD (dim {args.dim}, seq {args.seq}): hyper_parallel {ours:.0f} µs, "
          f"torch DTensor {theirs:.0f} µs, ratio {ours / theirs:.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"ops": rows, "op_tables": tables, "tp_block": block, "args": vars(args)}, f, indent=1)


def main(argv=None):
    from benchmarks.cp_launch import run_or_spawn
    return run_or_spawn(run_rank, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
