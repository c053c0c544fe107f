"""Train torchtitan's Llama 3 model code (tiny, random init) with TP+SP × CP × DP on local CPU ranks.

    python examples/train_llama_titan.py --cp 2 --tp 2 --mode ulysses --steps 5 --check
    torchrun --nproc_per_node 4 examples/train_llama_titan.py --cp 2 --tp 2     # or under a launcher

The model is torchtitan's own ``Llama3Model`` (``torchtitan.models.llama3``); only the
parallelization is this library's: torchtitan's tensor + sequence parallel plan written with
hyper_parallel's styles (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``), ``ContextParallel`` on each layer's inner attention and ``data_parallel``
over the dp × cp ranks (``--dp-shard N``: ``fully_shard`` on each block and the root over the
flattened dp_shard × cp ranks instead, as torchtitan's FSDP2). Without a launcher it spawns
dp × dp_shard × cp × tp local ranks (gloo). Every step prints the global loss; ``--check`` then
trains the same model on the same batches in one process and fails unless every step's loss matches
to 1e-5 (fp32).
Needs ``pip install 'hyper-parallel[titan]'`` (torchtitan 0.3 and triton, which imports on CPU).
"""
import os
import sys

import torch

try:
    import _common
except ImportError:   # loaded by its path (a test): the examples folder is not on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _common


def parse_args(argv=None):
    kv_heads = ("--kv-heads", {"type": int, "default": None,
                               "help": "grouped-query attention (default: --heads)"})
    return _common.parser(__doc__, cp=True, tp_help="tensor-parallel ranks (with sequence parallel)",
                          extra=[kv_heads], dp_shard=True).parse_args(argv)


def validate(args):
    """Reject sizes the layout cannot split, on every rank before any collective."""
    kv = args.kv_heads or args.heads
    lb = _common.CP_MODES[args.mode].get("load_balance", False)
    checks = [
        (args.heads % args.tp == 0 and kv % args.tp == 0, f"--tp {args.tp} must divide --heads {args.heads} "
         f"and --kv-heads {kv} (each TP rank holds whole heads)"),
        (args.seq % (args.cp * args.tp * (2 if lb else 1)) == 0, f"--seq {args.seq} must divide by cp × tp "
         f"{'× 2 (load balancing) ' if lb else ''}= {args.cp * args.tp * (2 if lb else 1)}: every rank holds "
         f"an equal sequence block"),
        (args.dim % args.heads == 0, f"--dim {args.dim} must divide by --heads {args.heads}"),
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
    """TP+SP on mesh["tp"], ContextParallel on every inner attention over mesh["cp"], fully_shard
    over dp_shard (× cp) when the mesh has that dim."""
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
                               ContextParallel(seq_dim=1, head_dim=2, **_common.CP_MODES[mode]))
    if "dp_shard" in mesh.mesh_dim_names:
        shard(model, mesh)
    return model


def shard(model, mesh):
    """fully_shard each block, then the root (torchtitan's FSDP2 layout), summing gradients: the
    loss is already each rank's share of the global token mean."""
    from hyper_parallel import fully_shard
    from hyper_parallel.integrations.hf_fully_shard import shard_mesh
    sharding = shard_mesh(mesh, "dp_shard", "cp")
    for layer in model.layers.values():
        fully_shard(layer, sharding, average=False)
    fully_shard(model, sharding, average=False)


def forward(model, ids, positions):
    return model(ids, positions)


def optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr)


def run(argv):
    """One rank's run (under a launcher or spawned by _common.launch); its exit status."""
    args = parse_args(argv)
    validate(args)
    return _common.run_rank(args, sys.modules[__name__])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    validate(args)   # before starting any rank
    try:
        import torchtitan  # noqa: F401
    except ImportError as e:
        print(f"this example needs torchtitan: pip install 'hyper-parallel[titan]' ({e})", file=sys.stderr)
        return 2
    return _common.launch(run, argv, args)


if __name__ == "__main__":
    sys.exit(main())
