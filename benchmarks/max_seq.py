"""The longest sequence that trains one step within a per-rank memory budget.

    python -m benchmarks.max_seq                     # tiny Llama, 2 local CPU ranks, 64 MiB per rank
    python -m benchmarks.max_seq --nproc 8 --device cuda --model meta-llama/Llama-3.1-8B --budget 80e9

For each configuration — plain Hugging Face on one rank, then context parallelism (Ulysses) on
``--nproc`` ranks, alone and with each of chunked_cross_entropy (``loss="chunked"``), tiled_mlp and
offload_activations, then all three — the longest sequence (a multiple of ``--granularity``)
whose training step (forward + backward, gradients included, optimizer not) peaks within
``--budget`` bytes on every rank, found by doubling then bisecting. Peak memory is the platform's
``track_peak_memory`` around the step (CPU: bytes of live tensor storages created in the step;
accelerators: the allocator's peak), so the weights themselves are not counted. Then the issue's
two goals (benchmarks/max_seq_goals.py). ``--model`` builds a real model's architecture from its
config (random weights; no download when the config is local) to size it on a cluster.

On CPU the host *is* the device: offloading moves bytes from one count to the same count, so the
offload rows cannot gain there (they show what the hooks cost); measure them on an accelerator.
"""
import argparse
import json
import os
import sys

CONFIGS = ("plain HF (1 rank)", "cp", "cp + chunked loss", "cp + tiled mlp", "cp + offload", "cp + all three")
TINY = dict(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=8192, max_position_embeddings=1 << 20)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.max_seq", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks (under torchrun: the world)")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda / npu")
    p.add_argument("--model", default="tiny", help="'tiny' (a small Llama) or a HF model name / config path")
    p.add_argument("--budget", type=float, default=64 * 2**20, help="per-rank peak bytes of one step")
    p.add_argument("--granularity", type=int, default=256, help="sequence lengths are multiples of this")
    p.add_argument("--start", type=int, default=512, help="first length tried")
    p.add_argument("--max-seq", type=int, default=1 << 17, help="stop searching above this length")
    p.add_argument("--chunk-size", type=int, default=256, help="chunked_cross_entropy tokens per tile (rows)")
    p.add_argument("--goal-chunk", type=int, default=1024, help="loss tile of the goal")
    p.add_argument("--mlp-chunks", type=int, default=8, help="tiled_mlp tiles")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of the rows")
    p.add_argument("--goal-tokens", type=int, default=16384, help="tokens of the goal measurements")
    p.add_argument("--goal-vocab", type=int, default=32000, help="vocab of the loss goal")
    p.add_argument("--goal-hidden", type=int, default=256, help="hidden size of the goal measurements")
    p.add_argument("--goal-intermediate", type=int, default=896, help="MLP intermediate size of the MLP goal")
    p.add_argument("--no-goals", action="store_true", help="skip the goal measurements")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    if args.granularity % args.nproc:
        p.error(f"--granularity {args.granularity} must be a multiple of --nproc {args.nproc} (CP splits it)")
    return args


def build_model(args):
    import torch
    import transformers
    if args.model == "tiny":
        config = transformers.LlamaConfig(**TINY)
    else:
        config = transformers.AutoConfig.from_pretrained(args.model)
    config.use_cache = False
    torch.manual_seed(0)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device)


def prepare(name, args, mesh):
    """The model of one row, and what wraps its step (offload) — built once, reused by every trial."""
    import contextlib
    from hyper_parallel import offload_activations, tiled_mlp
    from hyper_parallel.integrations.hf_chunked_loss import apply_chunked_loss
    from hyper_parallel.integrations.transformers import parallelize_model
    model = build_model(args)
    if name.startswith("plain"):
        return model, contextlib.nullcontext
    all_three = name == "cp + all three"
    model = parallelize_model(model, mesh)
    if all_three or "chunked" in name:     # loss="chunked" with --chunk-size tiles
        apply_chunked_loss(model, context_parallel=True, chunk_size=args.chunk_size)
    if all_three or "tiled" in name:
        for layer in model.model.layers:
            tiled_mlp(layer.mlp, args.mlp_chunks)
    return model, (offload_activations if all_three or "offload" in name else contextlib.nullcontext)


def step_peak(model, wrap, seq, args, mesh, chunked):
    """Peak bytes of one forward + backward at global length ``seq`` on this rank (inf: out of memory)."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import get_platform, shard_sequence
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq)).to(args.device)
    shifted = F.pad(ids[:, 1:], (0, 1), value=-100)
    for p in model.parameters():
        p.grad = None        # the step's gradients count
    try:
        with get_platform().track_peak_memory() as memory:
            with wrap():
                if mesh is None:
                    loss = model(input_ids=ids, labels=ids).loss
                else:
                    count = (shifted != -100).sum()
                    ids, shifted = shard_sequence([ids, shifted], mesh)
                    loss = _cp_loss(model, ids, shifted, count, chunked)
                loss.backward()
        return memory.peak_bytes
    except torch.OutOfMemoryError:
        return float("inf")


def _cp_loss(model, ids, shifted, count, chunked):
    """This rank's share of the global mean loss: the chunked forward, or the logits path of
    docs/training.md (the model's own loss keywords would reach attention, which CP refuses)."""
    import torch.nn.functional as F
    if chunked:
        return model(input_ids=ids, shift_labels=shifted, num_items_in_batch=count).loss
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(), reduction="sum") / count


def longest(fits, args):
    """The longest multiple of the granularity that fits: double from --start, then bisect."""
    g = args.granularity
    low, high = 0, None
    seq = max(g, args.start // g * g)
    while seq <= args.max_seq:
        if not fits(seq):
            high = seq
            break
        low, seq = seq, seq * 2
    if high is None:
        return low, True            # still fitting at --max-seq
    while high - low > g:
        mid = (low + high) // 2 // g * g
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low, False


def run_row(name, args, mesh):
    from hyper_parallel import get_platform
    platform = get_platform()
    plain = name.startswith("plain")
    model, wrap = prepare(name, args, mesh)
    peaks = {}

    def fits(seq):
        import torch
        peak = step_peak(model, wrap, seq, args, None if plain else mesh, "chunked" in name or "all" in name)
        if not plain:   # every rank must fit: the largest rank's peak decides, on every rank alike
            peak = platform.all_reduce(torch.tensor([float(peak)]), mesh.get_group(), op="max").item()
        peaks[seq] = peak
        return peak <= args.budget
    seq, capped = longest(fits, args)
    return dict(config=name, max_seq=seq, capped=capped, peak_at_max=peaks.get(seq), trials=len(peaks))


def rank_main(args):
    import torch
    from hyper_parallel import get_platform, init_device_mesh
    platform = get_platform()
    platform.init_process_group()
    torch.set_num_threads(1)
    rank = platform.get_rank()
    mesh = init_device_mesh(args.device, (platform.get_world_size(),), mesh_dim_names=("cp",))
    rows = []
    for name in [c for c in CONFIGS if c in args.configs.split(",")]:
        if name.startswith("plain"):   # one rank holds the whole sequence; the others wait
            row = run_row(name, args, mesh) if rank == 0 else None
            platform.barrier()
        else:
            row = run_row(name, args, mesh)
        if rank == 0:
            rows.append(row)
            print(format_row(row), flush=True)
    goals = None
    if rank == 0 and not args.no_goals:
        from benchmarks.max_seq_goals import format_rows, measure
        goals = measure(args)
        print(format_rows(goals), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(budget=args.budget, nproc=platform.get_world_size(), model=args.model, rows=rows,
                           goals=goals), f, indent=1)
    platform.barrier()
    return 0


def format_row(row):
    more = "+ (the --max-seq cap)" if row["capped"] else ""
    peak = row["peak_at_max"]
    peak = "-" if peak is None else f"{peak / 2**20:.1f} MiB"
    return (f"{row['config']:20s} max seq {row['max_seq']:>8d}{more:22s} peak there {peak:>12s}  "
            f"({row['trials']} trials)")


def _rank(rank, args, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    sys.exit(rank_main(args))


def main(argv=None):
    args = parse_args(argv)
    print(f"budget {args.budget / 2**20:.1f} MiB per rank, {args.nproc} ranks, model {args.model}",
          flush=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # under torchrun: this process is a rank
        return rank_main(args)
    import torch.multiprocessing as mp
    from benchmarks.cp_launch import free_port
    context = mp.start_processes(_rank, args=(args, free_port()), nprocs=args.nproc, join=False,
                                 start_method="spawn")
    try:
        while not context.join():
            pass
    except Exception as exc:  # a rank failed or exited non-zero
        print(f"max_seq failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
