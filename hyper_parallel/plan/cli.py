"""The command line: ``dry-run`` (one rank's step, optionally predicted on a device) and ``search``."""
import argparse
import json
import sys
from typing import List, Optional

from hyper_parallel.plan.options import CP_MODES, FEATURES


def _mesh(text: str) -> dict:
    sizes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size.strip().isdigit():
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: write dim=size pairs, e.g. dp_shard=2,cp=4")
        sizes[name.strip()] = int(size)
    return sizes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.plan")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("dry-run", "search"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True, help="a built-in name or a Hugging Face config.json")
        p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
        p.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank")
        p.add_argument("--device", default=None if name == "dry-run" else "h100",
                       help="h100, h200, a100, b200, ascend910b or cpu (calibrated here)")
        p.add_argument("--gpus-per-node", type=int, default=8)
        p.add_argument("--memory-gib", type=float, default=None,
                       help="device memory to fit in (default: the device's)")
        p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                       help="parameters and compute (with --master-dtype: gathered parameters and compute)")
        p.add_argument("--master-dtype", default=None, choices=("float32",),
                       help="mixed precision: sharded master weights, gradients, AdamW state in this dtype "
                            "(fully_shard's MixedPrecisionPolicy(param_dtype=--dtype))")
        p.add_argument("--reduce-dtype", default=None, choices=("bfloat16", "float32"),
                       help="with --master-dtype: gradients reduce-scattered in this dtype (default --dtype)")
        p.add_argument("--layers", type=int, default=None,
                       help="run k and 2k layers and scale to the model's (default: dry-run the whole model; "
                            "search: one period of the layer pattern)")
        p.add_argument("--json", action="store_true")
    dry = sub.choices["dry-run"]
    dry.add_argument("--mesh", type=_mesh, required=True, help="e.g. dp_shard=2,cp=4,tp=2")
    dry.add_argument("--cp-mode", choices=sorted(CP_MODES), default=None)
    dry.add_argument("--features", default="chunked_loss", help=f"comma-separated, of {','.join(FEATURES)}")
    dry.add_argument("--rank", type=int, default=0)
    dry.add_argument("--ep", default=None,
                     help="expert parallelism over these data dims, e.g. dp_shard or dp_shard,cp")
    search = sub.choices["search"]
    search.add_argument("--gpus", type=int, required=True)
    search.add_argument("--all-modes", action="store_true", help="also the unbalanced allgather and ring")
    search.add_argument("--tp", default=None, help="only these tp degrees, e.g. 4,8")
    search.add_argument("--cp", default=None, help="only these cp degrees, e.g. 16,32")
    search.add_argument("--cp-modes", default=None, help="only these CP modes, e.g. zigzag,ulysses")
    return parser


def _dry_run(args) -> int:
    from hyper_parallel.plan.dry_run import dry_run
    from hyper_parallel.plan.models import model_fn
    from hyper_parallel.plan.roofline import predict
    from hyper_parallel.plan.scaling import scaled_dry_run
    features = tuple(f for f in args.features.split(",") if f)
    _, total = model_fn(args.model, dtype=args.dtype)
    extra = {} if args.ep is None else {"ep": args.ep if "," not in args.ep else tuple(args.ep.split(","))}
    extra.update(_precision(args))

    def run(layers):
        build, _ = model_fn(args.model, layers=layers, dtype=args.master_dtype or args.dtype)
        return dry_run(build, tuple(args.mesh.values()), tuple(args.mesh), rank=args.rank, seq_len=args.seq,
                       batch=args.batch, cp_mode=args.cp_mode, features=features, model_name=args.model,
                       **extra)
    report = scaled_dry_run(run, args.layers, total) if args.layers else run(None)
    if args.device:
        memory = args.memory_gib * 2 ** 30 if args.memory_gib else None
        report.prediction = predict(report, args.device, args.gpus_per_node, memory_bytes=memory)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.format())
    return 0


def _precision(args: argparse.Namespace) -> dict:
    if args.master_dtype is None:
        if args.reduce_dtype is not None:
            raise ValueError("--reduce-dtype is fully_shard's mixed-precision setting: pass --master-dtype "
                             "float32 with it")
        return {}
    return {"param_dtype": args.dtype, "reduce_dtype": args.reduce_dtype}


def _ints(text: Optional[str]):
    return tuple(int(x) for x in text.split(",")) if text else None


def _search(args) -> int:
    from hyper_parallel.plan.search import Searcher, public, table
    _precision(args)
    searcher = Searcher(args.model, args.seq, args.gpus, args.device, args.gpus_per_node, args.batch,
                        args.memory_gib, args.dtype, args.layers, master_dtype=args.master_dtype,
                        reduce_dtype=args.reduce_dtype)
    only = {"tp": _ints(args.tp), "cp": _ints(args.cp),
            "modes": tuple(args.cp_modes.split(",")) if args.cp_modes else None}
    for mode in only["modes"] or ():
        if mode not in CP_MODES:
            raise ValueError(f"--cp-modes: {mode!r} is not one of {sorted(CP_MODES)}")
    result = searcher.run(all_modes=args.all_modes, progress=True, only=only)
    for mesh, mode, features, reason in searcher.refused:
        print(f"refused {mesh} {mode} {','.join(features)}: {reason}", file=sys.stderr)
    print(json.dumps(public(result), indent=1) if args.json else table(result))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dry_run(args) if args.command == "dry-run" else _search(args)
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
