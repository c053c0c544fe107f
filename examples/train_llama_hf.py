"""Train a tiny Hugging Face Llama (random init) with TP × CP × DP on local CPU ranks.

    python examples/train_llama_hf.py --cp 2 --tp 2 --mode ulysses --steps 5 --check
    torchrun --nproc_per_node 4 examples/train_llama_hf.py --cp 2 --tp 2     # or under a launcher

Without a launcher it spawns dp × cp × tp local ranks (gloo). Every step prints the global loss;
``--check`` then trains the same model on the same batches in one process and fails unless every
step's loss matches to 1e-5 (fp32). Needs ``pip install 'hyper-parallel[hf]'``.
"""
import argparse
import multiprocessing
import os
import socket
import sys

import torch
import torch.nn.functional as F

MODES = {
    "ulysses": {},
    "allgather": {"ulysses_degree": 1},
    "allgather-lb": {"ulysses_degree": 1, "load_balance": True},
    "hybrid": {"ulysses_degree": 2},
    "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
    "ring-zigzag": {"ulysses_degree": 1, "load_balance": True, "kv_exchange": "ring"},
}
TOLERANCE = 1e-5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--mode", choices=sorted(MODES), default="ulysses", help="context-parallel attention mode")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check", action="store_true", help="compare with the same training in one process")
    return p.parse_args(argv)


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def global_batch(args, step, dp_index):
    """input ids and labels shifted on the whole sequence (the last position predicts nothing)."""
    g = torch.Generator().manual_seed(1000 * step + dp_index)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], 1)
    return ids, labels


def token_count(args, step):
    """Counted labels over every data-parallel batch of the step (the loss normaliser)."""
    return sum(int((global_batch(args, step, d)[1] != -100).sum()) for d in range(args.dp))


def sum_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def optimizer(model, args):
    # foreach=False: the multi-tensor path does not take DTensor parameters yet (issue 16, item 4)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)


def train_parallel(args):
    from hyper_parallel import data_parallel, get_platform, init_device_mesh, shard_sequence
    from hyper_parallel.integrations.transformers import parallelize_model

    platform = get_platform()
    mesh = init_device_mesh(platform.device_type, (args.dp, args.cp, args.tp),
                            mesh_dim_names=("dp", "cp", "tp"))
    model = parallelize_model(build_model(args), mesh, **MODES[args.mode])
    replicas = mesh["dp", "cp"].flatten()  # ranks that see different tokens for the same parameters
    data_parallel(model, replicas, average=False)
    opt = optimizer(model, args)
    losses = []
    for step in range(args.steps):
        ids, labels = global_batch(args, step, mesh["dp"].get_local_rank())
        ids, labels = shard_sequence([ids, labels], mesh["cp"])
        loss = sum_loss(model(input_ids=ids).logits, labels) / token_count(args, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = float(platform.all_reduce(loss.detach(), replicas.get_group()))
        losses.append(total)
        if platform.get_rank() == 0:
            print(f"[{step + 1}/{args.steps}] loss {total:.6f}", flush=True)
    return losses


def train_single(args):
    model = build_model(args)
    opt = optimizer(model, args)
    losses = []
    for step in range(args.steps):
        count = token_count(args, step)
        loss = sum(sum_loss(model(input_ids=ids).logits, labels) / count
                   for ids, labels in (global_batch(args, step, d) for d in range(args.dp)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def run(args):
    from hyper_parallel import get_platform
    losses = train_parallel(args)
    platform = get_platform()
    if not args.check or platform.get_rank() != 0:
        return 0
    print("reference: the same training in one process ...", flush=True)
    reference = train_single(args)
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"max |loss - single-process loss| over {args.steps} steps: {diff:.2e} (tolerance {TOLERANCE:.0e})",
          flush=True)
    return 0 if diff <= TOLERANCE else 1


def _worker(rank, world, port, argv):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.exit(run(parse_args(argv)))


def spawn(args, argv):
    world = args.dp * args.cp * args.tp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, port, argv)) for r in range(world)]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):  # one failed: the rest would wait forever
            for p in procs:
                p.terminate()
        procs[0].join(0.2)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"ranks {failed} failed (exit codes {[procs[r].exitcode for r in failed]})", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" in os.environ:
        return run(args)
    print(f"spawning {args.dp * args.cp * args.tp} local ranks: dp={args.dp} cp={args.cp} tp={args.tp} "
          f"mode={args.mode}", flush=True)
    return spawn(args, argv)


if __name__ == "__main__":
    sys.exit(main())
