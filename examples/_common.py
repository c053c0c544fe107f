"""What the examples share (not an example itself): their command-line flags, ``--check``'s
comparison with the same training in one process, and -- for the torch examples -- the training
loops and the local launcher that starts one process per rank when no launcher (torchrun) did.

An example imports it as a sibling module: ``python examples/x.py`` and torchrun put examples/ first
on ``sys.path``; a test loading an example by its path gets it added by the example. torch is
imported inside the functions that use it, so the MindSpore example (run by an interpreter without
torch) can import this module.
"""
import argparse
import multiprocessing
import os
import socket
import sys

TOLERANCE = 1e-5
# ContextParallel's attention modes by the torch examples' --mode name
CP_MODES = {
    "ulysses": {},
    "allgather": {"ulysses_degree": 1},
    "allgather-lb": {"ulysses_degree": 1, "load_balance": True},
    "hybrid": {"ulysses_degree": 2},
    "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
    "ring-zigzag": {"ulysses_degree": 1, "load_balance": True, "kv_exchange": "ring"},
}


def check_mode(args):
    """--mode against --cp, before any process starts: a hybrid needs a Ulysses degree of 2 and at
    least 2 all-gather groups, so --cp 2 would run plain Ulysses under the hybrid's name. --dp-shard
    with --dp and --cp both above 1 would be HSDP over a flattened dp_shard × cp mesh, which
    fully_shard does not take (its HSDP mesh is exactly (dp_replicate, dp_shard))."""
    if getattr(args, "mode", None) == "hybrid" and (args.cp < 4 or args.cp % 2):
        raise ValueError(f"--mode hybrid runs Ulysses over 2 ranks × all-gather over cp / 2; it needs an even "
                         f"--cp of at least 4, got --cp {args.cp} (at --cp 2 use --mode ulysses)")
    shard = dp_shard_degree(args)
    if shard < 1:
        raise ValueError(f"--dp-shard {shard}: pass a positive number of ranks")
    if shard > 1 and args.dp > 1 and getattr(args, "cp", 1) > 1:
        raise ValueError(f"--dp {args.dp} --dp-shard {shard} --cp {args.cp}: HSDP (--dp × --dp-shard) with "
                         f"context parallelism is not supported; use --cp 1, or fold --dp into --dp-shard "
                         f"(--dp 1 --dp-shard {args.dp * shard})")


def dp_shard_degree(args):
    return getattr(args, "dp_shard", 1)


def data_ranks(args):
    """Ranks that read different batches: --dp × --dp-shard."""
    return args.dp * dp_shard_degree(args)


def parser(doc, *, width_flag="--dim", cp=False, tp_help="tensor-parallel ranks", extra=(), checkpoint=False,
           dp_shard=False, compile=False, **defaults):
    """The examples' flags. ``width_flag`` names the model-width flag; ``cp`` adds --cp and --mode;
    ``dp_shard`` adds --dp-shard (fully_shard's ranks; see train_parallel);
    ``compile`` adds --compile [BACKEND] (each decoder layer compiled, docs/compile.md);
    ``extra`` is (flag, add_argument keywords) pairs of an example's own model flags; ``checkpoint``
    adds --save, --resume and --json (torch examples: see save_checkpoint / load_checkpoint);
    ``defaults`` overrides a flag's default (dp, tp, seq, width, vocab, lr)."""
    d = {"dp": 1, "tp": 1, "seq": 64, "width": 64, "vocab": 128, "lr": 1e-3, **defaults}
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if cp:
        p.add_argument("--cp", type=int, default=2, help="context-parallel ranks")
    p.add_argument("--tp", type=int, default=d["tp"], help=tp_help)
    p.add_argument("--dp", type=int, default=d["dp"], help="data-parallel ranks")
    if dp_shard:
        p.add_argument("--dp-shard", type=int, default=1, help="sharded data-parallel ranks (fully_shard: "
                       "ZeRO-3; with --dp > 1 HSDP, --dp replicas of --dp-shard shards)")
    if cp:
        p.add_argument("--mode", choices=sorted(CP_MODES), default="ulysses",
                       help="context-parallel attention mode")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    p.add_argument("--seq", type=int, default=d["seq"])
    p.add_argument(width_flag, type=int, default=d["width"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    for flag, keywords in extra:
        p.add_argument(flag, **keywords)
    p.add_argument("--vocab", type=int, default=d["vocab"])
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--check", action="store_true", help="compare with the same training in one process")
    if compile:
        p.add_argument("--compile", nargs="?", const="inductor", metavar="BACKEND",
                       help="torch.compile each decoder layer after parallelizing it (default backend "
                       "inductor; aot_eager traces the same graphs without generating code)")
    if checkpoint:
        p.add_argument("--save", metavar="DIR", help="after the last step, save model and optimizer (DCP)")
        p.add_argument("--resume", metavar="DIR", help="load a --save checkpoint (any layout), then train "
                       "--steps more steps")
        p.add_argument("--json", metavar="PATH", help="write the first step's number and the losses here")
    return p


def compare_with_one_process(losses, train_single, args):
    """``--check`` on rank 0: the exit status, 0 when every step's loss equals ``train_single``'s."""
    print("reference: the same training in one process ...", flush=True)
    reference = train_single(args)
    reference = reference[len(reference) - len(losses):]   # a resumed run: its last steps
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"max |loss - single-process loss| over {len(losses)} steps: {diff:.2e} "
          f"(tolerance {TOLERANCE:.0e})", flush=True)
    return 0 if diff <= TOLERANCE else 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ torch: training
def global_batch(args, step, dp_index):
    """Input ids, labels shifted on the whole sequence (the last position predicts nothing), and
    the positions RoPE rotates by (a CP rank's block must use its global positions)."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + dp_index)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], 1)
    positions = torch.arange(args.seq).expand(args.batch, -1)
    return ids, labels, positions


def token_count(args, step):
    """Counted labels over every data-parallel batch of the step (the loss normaliser)."""
    return sum(int((global_batch(args, step, d)[1] != -100).sum()) for d in range(data_ranks(args)))


def sum_loss(logits, labels):
    import torch.nn.functional as F
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def _train(args, opt, step_loss, global_loss, verbose, first=0):
    """Steps ``first`` .. ``first + args.steps - 1`` (a resumed run starts past the saved ones)."""
    losses = []
    last = first + args.steps
    for step in range(first, last):
        loss = step_loss(step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss.detach()))
        if verbose:
            print(f"[{step + 1}/{last}] loss {losses[-1]:.6f}", flush=True)
    return losses


def train_parallel(args, example):
    """This rank's part of the training; every step's global loss. ``example`` supplies
    build_model(args), parallelize(model, mesh, mode), forward(model, ids, positions) and
    optimizer(model, args). ``--resume`` loads a checkpoint first; ``--save`` writes one after."""
    from hyper_parallel import data_parallel, get_platform, init_device_mesh, shard_sequence

    first = steps_saved(args)   # checks --resume's flags before any collective
    platform = get_platform()
    shard = dp_shard_degree(args)
    # --dp-shard: example.parallelize applies fully_shard over dp_shard (× cp), summing gradients
    # (the loss is already each rank's share of the global mean); otherwise data_parallel does
    names = ("dp", "cp", "tp") if shard == 1 else ("dp_replicate", "dp_shard", "cp", "tp")
    sizes = (args.dp, args.cp, args.tp) if shard == 1 else (args.dp, shard, args.cp, args.tp)
    mesh = init_device_mesh(platform.device_type, sizes, mesh_dim_names=names)
    backend = getattr(args, "compile", None)   # --compile: parallelize_model(compile=...)
    model = example.parallelize(example.build_model(args), mesh, args.mode,
                                **({"compile": {"backend": backend}} if backend else {}))
    replicas = mesh[names[:-1]].flatten()  # ranks that see different tokens for the same parameters
    if shard == 1:
        data_parallel(model, replicas, average=False)
    opt = example.optimizer(model, args)
    if getattr(args, "resume", None):
        load_checkpoint(model, opt, args.resume)
    data_index = mesh[names[0]].get_local_rank() * shard
    if shard > 1:
        data_index += mesh["dp_shard"].get_local_rank()

    def step_loss(step):
        batch = global_batch(args, step, data_index)
        ids, labels, positions = shard_sequence(list(batch), mesh["cp"])
        return sum_loss(example.forward(model, ids, positions), labels) / token_count(args, step)
    losses = _train(args, opt, step_loss, lambda loss: float(platform.all_reduce(loss, replicas.get_group())),
                    verbose=platform.get_rank() == 0, first=first)
    if getattr(args, "save", None):
        save_checkpoint(model, opt, args, first + args.steps)
    return losses


def train_single(args, example):
    """The same training in one process, from step 1 through a resumed run's last step: every
    data-parallel batch of a step in one loss."""
    model = example.build_model(args)
    whole = argparse.Namespace(**{**vars(args), "steps": steps_saved(args) + args.steps})

    def step_loss(step):
        count = token_count(args, step)
        return sum(sum_loss(example.forward(model, ids, positions), labels) / count
                   for ids, labels, positions in (global_batch(args, step, d)
                                                  for d in range(data_ranks(args))))
    return _train(whole, example.optimizer(model, args), step_loss, float, verbose=False)


def run_rank(args, example):
    """One rank's run of a torch example; its exit status."""
    import json
    from hyper_parallel import get_platform
    losses = train_parallel(args, example)
    if get_platform().get_rank() != 0:
        return 0
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump({"first_step": steps_saved(args) + 1, "losses": losses}, f)
    if not args.check:
        return 0
    return compare_with_one_process(losses, lambda a: train_single(a, example), args)


# ------------------------------------------------------------------------------ torch: checkpoints
# flags a resumed run may change: the layout and the run itself; the rest fix the model, data and optimizer
LAYOUT_FLAGS = ("tp", "cp", "mode", "steps", "check", "save", "resume", "json")
TRAINING_FILE = "training.json"   # beside the DCP files: the steps done and the flags that must not change


def save_checkpoint(model, opt, args, steps_done):
    """DCP save of the model's and optimizer's state (each rank writes its shards) to ``args.save``;
    rank 0 adds the steps done and the flags, so ``--resume`` can continue on any layout."""
    import json
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from hyper_parallel import get_platform
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=args.save)
    if get_platform().get_rank() == 0:
        fixed = {k: v for k, v in vars(args).items() if k not in LAYOUT_FLAGS}
        with open(os.path.join(args.save, TRAINING_FILE), "w") as f:
            json.dump({"steps": steps_done, "flags": fixed}, f)


def load_checkpoint(model, opt, directory):
    """Loads a ``save_checkpoint`` into the parallelized ``model`` and its ``opt``: DCP reads,
    for each rank's shards, the saved blocks overlapping them, whatever the saved layout was."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optim_state = get_state_dict(model, opt)   # creates the optimizer state to load into
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def steps_saved(args):
    """The steps ``--resume``'s checkpoint had done (0 without --resume); a ValueError, on every
    rank before any collective, when a flag that fixes the model, data or optimizer differs."""
    import json
    directory = getattr(args, "resume", None)
    if not directory:
        return 0
    path = os.path.join(directory, TRAINING_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"--resume {directory}: no {TRAINING_FILE} there; "
                         "pass a directory written by --save")
    with open(path) as f:
        saved = json.load(f)
    for key, value in saved["flags"].items():
        if vars(args).get(key) != value:
            raise ValueError(f"--resume {directory}: the checkpoint was trained with --{key} {value}, "
                             f"this run has --{key} {vars(args).get(key)}; pass --{key} {value} (only "
                             f"{', '.join('--' + k for k in LAYOUT_FLAGS[:3])} may change)")
    return saved["steps"]


# ------------------------------------------------------------------------------ torch: launcher
def launch(run, argv, args):
    """``run(argv)`` here under a launcher (``RANK`` set); otherwise in dp × cp × tp spawned local
    ranks (gloo). ``run`` must be a module-level function of the example (it is pickled)."""
    check_mode(args)
    if "RANK" in os.environ:
        return run(argv)
    world = data_ranks(args) * args.cp * args.tp
    print(f"spawning {world} local ranks: dp={args.dp} dp_shard={dp_shard_degree(args)} cp={args.cp} "
          f"tp={args.tp} mode={args.mode}", flush=True)
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(run, r, world, port, argv)) for r in range(world)]
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


def _worker(run, rank, world, port, argv):
    import torch
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.exit(run(argv))
