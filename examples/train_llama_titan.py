"""Train torchtitan's Llama 3 model code (tiny, random init) with TP+SP × CP × DP on local CPU ranks.

    python examples/train_llama_titan.py --cp 2 --tp 2 --mode ulysses --steps 5 --check
    torchrun --nproc_per_node 4 examples/train_llama_titan.py --cp 2 --tp 2     # or under a launcher

The model is torchtitan's own ``Llama3Model`` (``torchtitan.models.llama3``); only the
parallelization is this library's: torchtitan's tensor + sequence parallel plan written with
hyper_parallel's styles (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``), ``ContextParallel`` on each layer's inner attention and ``data_parallel``
over the dp × cp ranks. Without a launcher it spawns dp × cp × tp local ranks (gloo). Every step
prints the global loss; ``--check`` then trains the same model on the same batches in one process
and fails unless every step's loss matches to 1e-5 (fp32).
Needs ``pip install 'hyper-parallel[titan]'`` (torchtitan 0.3 and triton, which imports on CPU).
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
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (with sequence parallel)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--mode", choices=sorted(MODES), default="ulysses", help="context-parallel attention mode")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention (default: --heads)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check", action="store_true", help="compare with the same training in one process")
    return p.parse_args(argv)


def validate(args):
    """Reject sizes the layout cannot split, on every rank before any collective."""
    kv = args.kv_heads or args.heads
    lb = MODES[args.mode].get("load_balance", False)
    checks = [
        (args.heads % args.tp == 0 and kv % args.tp == 0, f"--tp {args.tp} must divide --heads {args.heads} "
         f"and --kv-heads {kv} (each TP rank holds whole heads)"),
        (args.seq % (args.cp * args.tp * (2 if lb else 1)) == 0, f"--seq {args.seq} must divide by cp × tp "
         f"{'× 2 (load balancing) ' if lb else ''}= {args.cp * args.tp * (2 if lb else 1)}: every rank holds "
         f"an equal sequence block"),
        (args.dim % args.heads == 0, f"--dim {args.dim} must divide by --heads {args.heads}"),
        (args.mode != "hybrid" or args.cp % 2 == 0, f"--mode hybrid needs an even --cp, got {args.cp}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def build_model(args):
    """torchtitan's Llama 3 at a tiny size, random init (torchtitan's own init_states)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    dim, heads = args.dim, args.heads
    init = {"weight": lambda w: torch.nn.init.normal_(w, std=0.02)}
    # SDPA inner attention: torchtitan's language-model default is FlexAttention with a block mask,
    # which ContextParallel does not split (parallelize() below raises for it).
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=args.seq, theta=500000.0)
    attention = [make_gqa_config(dim=dim, n_heads=heads, n_kv_heads=args.kv_heads, wqkv_param_init=init,
                                 wo_param_init=init, inner_attention=ScaledDotProductAttention.Config(),
                                 fuse_qkv=False, rope=rope)
                 for _ in range(args.layers)]
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim), ffn_norm=RMSNorm.Config(normalized_shape=dim),
        attention=a, feed_forward=make_ffn_config(dim=dim, hidden_dim=2 * dim, w1_param_init=init,
                                                  w2w3_param_init=init)) for a in attention]
    config = Llama3Model.Config(dim=dim, vocab_size=args.vocab, layers=layers,
                                tok_embeddings=Embedding.Config(num_embeddings=args.vocab, embedding_dim=dim),
                                norm=RMSNorm.Config(normalized_shape=dim),
                                lm_head=Linear.Config(in_features=dim, out_features=args.vocab))
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


def tp_plan():
    """torchtitan's Llama TP + sequence-parallel plan in hyper_parallel's styles. Between blocks the
    activations are sequence shards over "tp"; inside attention and the MLP they are whole (this CP
    rank's block) and split over heads / hidden units. The logits come back whole."""
    from hyper_parallel import (ColwiseParallel, PrepareModuleInput, Replicate, RowwiseParallel,
                                SequenceParallel, Shard)
    seq_in = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        # attention(x, attention_masks, positions): only x changes layout
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                 desired_input_layouts=(Replicate(), None, None)),
        "layers.*.attention.qkv_linear.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": seq_in,
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def parallelize(model, mesh, mode):
    """TP+SP on mesh["tp"], ContextParallel on every inner attention over mesh["cp"]."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from hyper_parallel import ContextParallel, parallelize_module
    for name, layer in model.layers.items():
        inner = layer.attention.inner_attention
        if not isinstance(inner, ScaledDotProductAttention):
            raise ValueError(f"layers.{name}.attention.inner_attention is {type(inner).__name__}; "
                             f"ContextParallel splits torchtitan's ScaledDotProductAttention only: build the "
                             f"model with inner_attention=ScaledDotProductAttention.Config()")
    if mesh["tp"].size() > 1:
        parallelize_module(model, mesh["tp"], tp_plan())
    if mesh["cp"].size() > 1:
        for layer in model.layers.values():   # q, k, v: (batch, seq, heads, head_dim)
            parallelize_module(layer.attention.inner_attention, mesh["cp"],
                               ContextParallel(seq_dim=1, head_dim=2, **MODES[mode]))
    return model


def global_batch(args, step, dp_index):
    """Input ids, labels shifted on the whole sequence (the last position predicts nothing), and
    the positions RoPE rotates by (a CP rank's block must use its global positions)."""
    g = torch.Generator().manual_seed(1000 * step + dp_index)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], 1)
    positions = torch.arange(args.seq).expand(args.batch, -1)
    return ids, labels, positions


def token_count(args, step):
    """Counted labels over every data-parallel batch of the step (the loss normaliser)."""
    return sum(int((global_batch(args, step, d)[1] != -100).sum()) for d in range(args.dp))


def sum_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def train_parallel(args):
    from hyper_parallel import data_parallel, get_platform, init_device_mesh, shard_sequence

    platform = get_platform()
    mesh = init_device_mesh(platform.device_type, (args.dp, args.cp, args.tp),
                            mesh_dim_names=("dp", "cp", "tp"))
    model = parallelize(build_model(args), mesh, args.mode)
    replicas = mesh["dp", "cp"].flatten()  # ranks that see different tokens for the same parameters
    data_parallel(model, replicas, average=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        batch = global_batch(args, step, mesh["dp"].get_local_rank())
        ids, labels, positions = shard_sequence(list(batch), mesh["cp"])
        loss = sum_loss(model(ids, positions), labels) / token_count(args, step)
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
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        count = token_count(args, step)
        loss = sum(sum_loss(model(ids, positions), labels) / count
                   for ids, labels, positions in (global_batch(args, step, d) for d in range(args.dp)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def run(args):
    from hyper_parallel import get_platform
    validate(args)
    losses = train_parallel(args)
    if not args.check or get_platform().get_rank() != 0:
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
    validate(args)   # before starting any rank
    try:
        import torchtitan  # noqa: F401
    except ImportError as e:
        print(f"this example needs torchtitan: pip install 'hyper-parallel[titan]' ({e})", file=sys.stderr)
        return 2
    if "RANK" in os.environ:
        return run(args)
    print(f"spawning {args.dp * args.cp * args.tp} local ranks: dp={args.dp} cp={args.cp} tp={args.tp} "
          f"mode={args.mode}", flush=True)
    return spawn(args, argv)


if __name__ == "__main__":
    sys.exit(main())
