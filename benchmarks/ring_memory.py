"""Ring attention's memory against single-device attention at the same local length:
``python -m benchmarks.ring_memory --nproc 4 --local 2048``.

Every number is the process's RSS high-water mark above its level before one forward+backward
(benchmarks/rss_peak.py; ``MALLOC_MMAP_THRESHOLD_`` pinned so freed blocks leave RSS), inputs and
the output gradient allocated before the region. ``single`` is SDPA on one rank's local block
(length ``--local``); ``ring`` is ``ring_attention`` over all ranks, each holding a block of that
length (global length P·local), the largest rank's peak; ``masked`` the same ring under
``attention_masks(document_ids=...)`` with ``--docs`` equal documents. The ratio ring/single is
what issue 17 asks to keep at or below 2.5, flat in P.
"""
import argparse
import os
import sys

if __package__ in (None, ""):   # run as a file (msrun benchmarks/x.py): the package is at the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import rss_peak


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.ring_memory", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--local", type=int, default=2048, help="tokens per rank")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads (GQA / MQA; default: --heads); must divide --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--docs", type=int, default=0, help="also measure the masked ring with N documents")
    p.add_argument("--zigzag", action="store_true")
    p.add_argument("--repeat", type=int, default=3, help="measurements per case; the smallest counts")
    return p.parse_args(argv)


def _inputs(torch, args, seed):
    gen = torch.Generator().manual_seed(seed)
    heads = (args.heads, args.kv_heads or args.heads, args.kv_heads or args.heads, args.heads)
    return [torch.randn((1, h, args.local, args.head_dim), generator=gen) for h in heads]


def _fwd_bwd(torch, fn, tensors):
    q, k, v, grad = tensors
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fn(*leaves).backward(grad)
    return [t.grad for t in leaves]


def _peak(torch, fn, tensors, repeat):
    _fwd_bwd(torch, fn, tensors)   # warm-up: lazy initialisation is not attention memory
    return min(rss_peak.rss_peak_bytes(lambda: _fwd_bwd(torch, fn, tensors)) for _ in range(repeat))


def run_rank(args):
    import torch
    import torch.nn.functional as F
    from hyper_parallel.core.context_parallel.masks.attention_masks import attention_masks
    from hyper_parallel.core.context_parallel.masks.masked_ring import masked_ring_attention
    from hyper_parallel.core.context_parallel.ring.ring_attention import RingLayout, ring_attention
    from hyper_parallel.platform import get_platform

    def _single(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

    platform = get_platform()
    platform.init_process_group()
    rank, world = platform.get_rank(), platform.get_world_size()
    tensors = _inputs(torch, args, rank)
    mib = 1 / 2 ** 20
    rows = {}
    if rank == 0:
        rows["single"] = _peak(torch, _single, tensors, args.repeat)
    platform.barrier()
    layout = RingLayout(tuple(range(world)), rank, args.zigzag)
    rows["ring"] = _peak(torch, lambda q, k, v: ring_attention(q, k, v, layout, True), tensors, args.repeat)
    if args.docs:
        total = args.local * world
        ids = (torch.arange(total) * args.docs // total).unsqueeze(0)
        with attention_masks(document_ids=ids) as masks:
            pass
        rows["masked"] = _peak(torch, lambda q, k, v: masked_ring_attention(q, k, v, layout, masks, True),
                               tensors, args.repeat)
    for name in ("ring", "masked"):
        if name in rows:
            peak = platform.all_reduce(torch.tensor([float(rows[name])]), None, "max")
            rows[name] = float(peak[0])
    if rank == 0:
        single = rows["single"]
        kv_heads = args.kv_heads or args.heads
        line = [f"P={world} L={args.local} H={args.heads} Hkv={kv_heads} D={args.head_dim} "
                f"zigzag={args.zigzag}: single {single * mib:.1f} MiB"]
        for name in ("ring", "masked"):
            if name in rows:
                line.append(f"{name} {rows[name] * mib:.1f} MiB ({rows[name] / single:.2f}x)")
        print(", ".join(line), flush=True)
    platform.destroy_process_group()


def main(argv=None):
    from benchmarks import cp_launch
    args = parse_args(argv)
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        raise ValueError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", rss_peak.MMAP_THRESHOLD)
    return cp_launch.run_or_spawn(run_rank, args)


if __name__ == "__main__":
    sys.exit(main())
