"""Train a tiny Hugging Face Llama (random init) with TP × CP × DP (or fully_shard) on local CPU ranks.

    python examples/train_llama_hf.py --cp 2 --tp 2 --mode ulysses --steps 5 --check
    python examples/train_llama_hf.py --dp-shard 2 --cp 1 --tp 2 --check     # ZeRO-3 × TP
    python examples/train_llama_hf.py --cp 1 --tp 2 --compile --check       # each layer torch.compiled
    torchrun --nproc_per_node 4 examples/train_llama_hf.py --cp 2 --tp 2     # or under a launcher

Without a launcher it spawns dp × cp × tp local ranks (gloo). Every step prints the global loss;
``--check`` then trains the same model on the same batches in one process and fails unless every
step's loss matches to 1e-5 (fp32). ``--save DIR`` writes a DCP checkpoint of the model and AdamW
state after the last step; ``--resume DIR`` loads it on whatever layout the flags give (another
--tp / --cp / --mode) and trains --steps more, which ``--check`` compares with one process training
every step straight through (docs/training.md, "Checkpoints"). ``--dp-shard N`` shards parameters,
gradients and AdamW state over N more ranks (``parallelize_model(..., dp_shard="dp_shard")``: each
decoder layer and the root under fully_shard, over the flattened dp_shard × cp ranks; with --dp > 1
HSDP), instead of data_parallel's replicas. Needs ``pip install 'hyper-parallel[hf]'``.
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
    return _common.parser(__doc__, width_flag="--hidden", cp=True, checkpoint=True,
                          dp_shard=True, compile=True).parse_args(argv)


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def parallelize(model, mesh, mode, compile=False):
    from hyper_parallel.integrations.transformers import parallelize_model
    # the loss is normalised by the global token count: fully_shard sums the gradients
    sharded = "dp_shard" in mesh.mesh_dim_names
    return parallelize_model(model, mesh, **({"average": False} if sharded else {}), **_common.CP_MODES[mode],
                             compile=compile)


def forward(model, ids, positions):
    # the model numbers the positions itself (parallelize_model gives a CP rank its block's)
    del positions
    return model(input_ids=ids).logits


def optimizer(model, args):
    # foreach=False: the multi-tensor path does not take DTensor parameters yet (issue 16, item 4)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)


def run(argv):
    """One rank's run (under a launcher or spawned by _common.launch); its exit status."""
    return _common.run_rank(parse_args(argv), sys.modules[__name__])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return _common.launch(run, argv, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
