"""fully_shard (ZeRO-3) against data_parallel and PyTorch's own FSDP2: ``python -m benchmarks.fully_shard``.

Spawns ``--nproc`` local CPU ranks (gloo) unless launched by torchrun. One MLP-block model (each
block a fully_shard unit, then the root) is trained three ways on the same batches:
hyper_parallel.fully_shard, hyper_parallel.data_parallel (every rank holds everything) and
torch.distributed.fsdp.fully_shard where it runs here. It prints, per rank:

* parameter + gradient + AdamW state bytes, counted from the tensors each rank holds, beside
  total / N (SPEC §11: at most 1.05 × total / N plus two gathered units), and the RSS peak;
* bytes sent in one training step, counted by CommDebugMode, beside the closed form
  (N−1)/N · (3 · unit bytes + 2 · root bytes) + the reduce-scatters' presence flags (one value per
  parameter and rank): every unit is gathered for forward and again for backward and
  reduce-scattered once; the root keeps its parameters from forward to backward (as
  FSDP2), so it is gathered once; with --no-reshard every unit is gathered once, 2 · P;
* step time (forward + backward + fused AdamW), the three interleaved round by round, medians and
  ratios (this machine is shared and noisy: only ratios measured in one run mean anything).
"""
import argparse
import os
import sys

if __package__ in (None, ""):   # run as a file: the package is at the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rank_common import (finish, interleaved_rounds, median_over_ranks, medians,  # noqa: E402
                                    write_json)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (default 4)")
    p.add_argument("--layers", type=int, default=4, help="MLP blocks (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="block width (default 256)")
    p.add_argument("--batch", type=int, default=16, help="rows per rank and step (default 16)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved timing rounds (default 6)")
    p.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    for name in ("nproc", "layers", "hidden", "batch", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def _model(torch, args):
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.up, self.down, self.norm = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.LayerNorm(h)

        def forward(self, x):
            return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))

    class Net(nn.Module):
        def __init__(self, h, layers):
            super().__init__()
            self.inp, self.head = nn.Linear(h, h), nn.Linear(h, h)
            self.blocks = nn.ModuleList(Block(h) for _ in range(layers))

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)
    torch.manual_seed(0)
    return Net(args.hidden, args.layers)


def _nbytes(t):
    local = getattr(t, "_local_tensor", None)
    if local is None and hasattr(t, "to_local"):
        local = t.to_local()
    t = t if local is None else local
    return t.numel() * t.element_size()


def _held_bytes(model, opt):
    params = sum(_nbytes(p) for p in model.parameters())
    grads = sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(_nbytes(v) for s in opt.state.values() for v in s.values() if hasattr(v, "numel"))
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


def _step(torch, model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def _setups(torch, args, mesh):
    from hyper_parallel import data_parallel, fully_shard
    setups = {}
    hp = _model(torch, args)
    for block in hp.blocks:
        fully_shard(block, mesh, reshard_after_forward=not args.no_reshard)
    fully_shard(hp, mesh, reshard_after_forward=not args.no_reshard)
    setups["hyper_parallel.fully_shard"] = hp
    setups["hyper_parallel.data_parallel"] = data_parallel(_model(torch, args), mesh)
    try:
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        theirs = _model(torch, args)
        tmesh = torch_mesh("cpu", (args.nproc,))
        for block in theirs.blocks:
            torch_fully_shard(block, mesh=tmesh, reshard_after_forward=not args.no_reshard)
        torch_fully_shard(theirs, mesh=tmesh, reshard_after_forward=not args.no_reshard)
        setups["torch FSDP2"] = theirs
    except Exception as exc:  # noqa: BLE001  (the peer is optional: report why it is absent)
        setups["torch FSDP2"] = f"skipped: {type(exc).__name__}: {str(exc)[:120]}"
    return setups


def _closed_form(model, n, reshard):
    """(N−1)/N · (3 · non-root unit bytes + 2 · root bytes); 2 · P without resharding; plus each
    reduce-scatter's presence flags, one fp32 per parameter and rank: (N−1) · 4 · parameters."""
    groups = [m._hp_fsdp_state.group for m in model.modules() if getattr(m, "_hp_fsdp_state", None)]
    root_bytes = sum(p.padded_numel * n * 4 for p in model._hp_fsdp_state.group.params)
    total = sum(p.padded_numel * n * 4 for g in groups for p in g.params)
    flags = (n - 1) * 4 * sum(len(g.params) for g in groups)
    units = total - root_bytes
    return (n - 1) / n * ((3 if reshard else 2) * units + 2 * root_bytes) + flags, (n - 1) / n * 3 * total


def run_rank(args):
    import torch
    from hyper_parallel import CommDebugMode, get_platform, init_device_mesh
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args.nproc,), mesh_dim_names=("dp",))
    rank = torch.distributed.get_rank()
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(rank))
    setups = _setups(torch, args, mesh)
    # fused AdamW for all three: one kernel call over the local shards (the per-tensor default on CPU
    # dispatches every DTensor op separately, which would time the dispatcher rather than sharding)
    runs = {k: (m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)) for k, m in setups.items()
            if not isinstance(m, str)}
    for model, opt in runs.values():
        _step(torch, model, opt, x)     # warm-up: optimizer state exists
    hp_model, hp_opt = runs["hyper_parallel.fully_shard"]
    with CommDebugMode() as comm:
        hp_model(x).pow(2).mean().backward()
    hp_opt.zero_grad(set_to_none=False)
    times, _ = interleaved_rounds(torch, list(runs), lambda name: _step(torch, *runs[name], x), args.rounds)
    closed, naive = _closed_form(hp_model, args.nproc, not args.no_reshard)
    result = {
        "rank": rank, "held": {k: _held_bytes(m, o) for k, (m, o) in runs.items()},
        "bytes_sent_step": comm.get_total_bytes(), "comm": comm.get_comm_counts(),
        "closed_form_bytes": closed, "naive_closed_form_bytes": naive,
        "step_ms": medians(times),
        "rss_peak_bytes": get_platform().peak_memory_bytes(),
        "skipped": {k: v for k, v in setups.items() if isinstance(v, str)},
    }
    finish(torch, args, result, _report)


def _report(args, results):
    n = args.nproc
    total_params = results[0]["held"]["hyper_parallel.data_parallel"]["total"]   # everything, on one rank
    print(f"{n} ranks, {args.layers} blocks of width {args.hidden}, batch {args.batch} per rank, "
          f"reshard_after_forward={not args.no_reshard}")
    print(f"{'rank':<6}{'fully_shard held B':>20}{'total / N':>14}{'ratio':>8}{'sent B/step':>14}"
          f"{'closed form':>14}{'RSS peak MiB':>14}")
    for r in results:
        held = r["held"]["hyper_parallel.fully_shard"]["total"]
        print(f"{r['rank']:<6}{held:>20,d}{total_params / n:>14,.0f}{held / (total_params / n):>8.3f}"
              f"{r['bytes_sent_step']:>14,d}{r['closed_form_bytes']:>14,.0f}"
              f"{r['rss_peak_bytes'] / 2**20:>14.1f}")
    print(f"(N-1)/N * 3 * parameter bytes (root counted 3x too): "
          f"{results[0]['naive_closed_form_bytes']:,.0f} B")
    med = median_over_ranks(results)
    base = med["hyper_parallel.fully_shard"]
    print("step time (median over ranks of each rank's median, interleaved rounds):")
    for name, ms in med.items():
        print(f"  {name:<30}{ms:>9.2f} ms   fully_shard / this = {base / ms:.2f}")
    for name, why in results[0]["skipped"].items():
        print(f"  {name:<30}{why}")
    if args.json:
        write_json(args.json, {"args": vars(args), "ranks": results, "step_ms": med})


def main(argv=None):
    from benchmarks.cp_launch import run_or_spawn
    return run_or_spawn(run_rank, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
