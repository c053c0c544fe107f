"""Train a small MindSpore transformer Cell with tensor parallelism x data parallelism on local CPU ranks.

    python examples/train_cell_mindspore.py --dp 2 --tp 2 --steps 5 --check
    msrun --worker_num 4 --local_worker_num 4 --master_addr 127.0.0.1 --master_port 8118 --join True \\
        examples/train_cell_mindspore.py --dp 2 --tp 2               # the same under MindSpore's launcher

Run with the MindSpore interpreter (``.venv-ms/bin/python``; for msrun put it first on ``PATH``).
Without a launcher (no ``MS_ROLE``) the script starts a MindSpore scheduler and ``dp x tp`` worker
processes itself and stops them all if one fails. The model -- embedding, causal attention, MLP,
RMS norms, an output head -- is parallelized with hyper_parallel's styles over ``mesh["tp"]``
(vocab-parallel embedding, Colwise q/k/v/MLP-in, Rowwise out-projections), and
``data_parallel(TrainOneStepCell(...), mesh["dp"])`` makes the train step all-reduce (mean) the
gradients over the data-parallel ranks, each of which trains on its slice of the batch
(``--dp-shard N``: ``fully_shard`` on each block and the root over N more data ranks instead,
sharding parameters, gradients and Adam's state; with --dp > 1 HSDP). Rank 0
prints every step's global loss; ``--check`` then trains the same model on the same batches in one
process and exits 1 unless every step's loss matches to 1e-5 (fp32).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

try:
    import _common
except ImportError:   # loaded by its path (a test): the examples folder is not on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLUSTER_ENV = ("MS_ROLE", "MS_NODE_ID", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "RANK_TABLE_FILE",
                "HP_EXAMPLE_LAUNCHED")
_OWN_LAUNCHER = "HP_EXAMPLE_LAUNCHED"   # set for the workers launch() starts (not msrun's)
_CHATTER = re.compile(r"^\[(DEBUG|INFO|WARNING|ERROR)\] [A-Z_]+\(")   # MindSpore's own log lines


def parse_args(argv=None):
    p = _common.parser(__doc__, dp=2, tp=2, seq=16, width=32, vocab=64, lr=1e-2, dp_shard=True)
    args = p.parse_args(argv)
    if args.heads % args.tp or args.vocab % args.tp or args.dim % args.heads:
        p.error(f"--heads ({args.heads}) and --vocab ({args.vocab}) must divide by --tp ({args.tp}), "
                f"--dim ({args.dim}) by --heads")
    if args.dp_shard < 1:
        p.error(f"--dp-shard {args.dp_shard}: pass a positive number of ranks")
    return args


# ------------------------------------------------------------------------------------------ model
def _block_classes(args):
    """(RMSNorm, Block): a pre-norm transformer block of causal attention and an MLP."""
    import mindspore as ms
    from mindspore import mint, nn, ops
    from hyper_parallel.platform.mindspore import scaled_dot_product_attention

    class RMSNorm(nn.Cell):
        def __init__(self, dim):
            super().__init__()
            self.weight = ms.Parameter(ops.ones(dim, ms.float32), name="weight")

        def construct(self, x):
            return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * self.weight

    class Attention(nn.Cell):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (mint.nn.Linear(args.dim, args.dim) for _ in range(4))
            self.head_dim = args.dim // args.heads

        def construct(self, x):
            b, s, _ = x.shape
            # under TP q/k/v hold this rank's heads: -1 is the local head count
            q, k, v = (f(x).reshape(b, s, -1, self.head_dim).swapaxes(1, 2) for f in (self.q, self.k, self.v))
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(out.swapaxes(1, 2).reshape(b, s, -1))

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = mint.nn.Linear(args.dim, 4 * args.dim), mint.nn.Linear(4 * args.dim, args.dim)

        def construct(self, x):
            return self.w2(ops.gelu(self.w1(x)))

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm1, self.attn = RMSNorm(args.dim), Attention()
            self.norm2, self.mlp = RMSNorm(args.dim), MLP()

        def construct(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
    return RMSNorm, Block


def build_model(args):
    """The transformer with deterministic weights (the same on every rank and in --check)."""
    import mindspore as ms
    from mindspore import mint, nn
    RMSNorm, Block = _block_classes(args)

    class Transformer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.dim)
            self.layers = nn.CellList([Block() for _ in range(args.layers)])
            self.norm = RMSNorm(args.dim)
            self.head = mint.nn.Linear(args.dim, args.vocab, bias=False)

        def construct(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    model = Transformer()
    for name, param in model.parameters_and_names():
        if not name.endswith("norm1.weight") and not name.endswith("norm2.weight") and name != "norm.weight":
            gen = np.random.RandomState(zlib.crc32(name.encode()))
            param.set_data(ms.Tensor((0.2 * gen.standard_normal(param.shape)).astype(np.float32)))
    return model


TP_PLAN = {"embed": "RowwiseParallel",                      # vocab-parallel lookup, one all-reduce
           "layers.*.attn.[qkv]": "ColwiseParallel",        # this rank's heads
           "layers.*.attn.o": "RowwiseParallel",
           "layers.*.mlp.w1": "ColwiseParallel",
           "layers.*.mlp.w2": "RowwiseParallel"}


def train_step(model, args):
    import mindspore as ms
    from mindspore import nn, ops

    class WithLoss(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.model = model

        def construct(self, ids, labels):
            logits = self.model(ids)
            return ops.cross_entropy(logits.reshape(-1, args.vocab), labels.reshape(-1))
    del ms
    return nn.TrainOneStepCell(WithLoss(), nn.Adam(model.trainable_params(), learning_rate=args.lr))


def batch(args, step, rows):
    """Step ``step``'s token ids and next-token labels, rows ``rows`` of the global batch."""
    import mindspore as ms
    data_ranks = args.dp * args.dp_shard
    shape = (args.batch * data_ranks, args.seq + 1)
    tokens = np.random.RandomState(1000 + step).randint(0, args.vocab, shape)
    tokens = tokens[rows].astype(np.int32)
    return ms.Tensor(tokens[:, :-1]), ms.Tensor(tokens[:, 1:])


# ------------------------------------------------------------------------------------------ runs
def train_parallel(args):
    """This rank's part; returns every step's global loss (the mean over data-parallel ranks)."""
    import mindspore as ms
    import hyper_parallel as hp
    from hyper_parallel import data_parallel, fully_shard, init_device_mesh, parallelize_module
    sharded = args.dp_shard > 1
    names = ("dp_replicate", "dp_shard", "tp") if sharded else ("dp", "tp")
    mesh = init_device_mesh("cpu", (args.dp, args.dp_shard, args.tp) if sharded else (args.dp, args.tp),
                            mesh_dim_names=names)
    data = mesh[names[:-1]].flatten() if sharded else mesh["dp"]   # ranks with different batches
    dp_rank = data.get_coordinate()[0]
    model = build_model(args)
    parallelize_module(model, mesh["tp"], {k: getattr(hp, v)() for k, v in TP_PLAN.items()})
    if sharded:   # each rank's loss is the mean over equal batches: fully_shard averages
        shard_mesh = mesh["dp_replicate", "dp_shard"] if args.dp > 1 else mesh["dp_shard"]
        for layer in model.layers:
            fully_shard(layer, shard_mesh)
        fully_shard(model, shard_mesh)
    step = train_step(model, args) if sharded else data_parallel(train_step(model, args), mesh["dp"])
    rows = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
    platform, group, losses = hp.get_platform(), data.get_group(), []
    for i in range(args.steps):
        start = time.time()
        loss = step(*batch(args, i, rows))
        loss = float(platform.all_reduce(loss.reshape(1), group, op="avg").asnumpy()[0])
        losses.append(loss)
        if mesh.get_rank() == 0:
            print(f"[{i + 1}/{args.steps}] loss {loss:.6f}  ({time.time() - start:.2f} s)", flush=True)
    del ms
    return losses


def train_single(args):
    model = build_model(args)
    step = train_step(model, args)
    return [float(step(*batch(args, i, slice(None))).asnumpy()) for i in range(args.steps)]


def rank_main(args):
    import mindspore as ms
    ms.set_context(mode=ms.PYNATIVE_MODE)
    os.environ.setdefault("HP_PLATFORM", "mindspore")
    losses = train_parallel(args)
    from hyper_parallel import get_platform
    if get_platform().get_rank() != 0 or not args.check:
        return 0
    return _common.compare_with_one_process(losses, train_single, args)


# ------------------------------------------------------------------------------------------ launcher
def launch(argv, world, timeout=1800):
    """A scheduler and ``world`` workers running this script; rank 0's output is shown, the others'
    when they fail. Returns the exit status (0 when every worker succeeded)."""
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_ENV}
    env.update(HP_PLATFORM="mindspore", MS_WORKER_NUM=str(world), MS_SCHED_HOST="127.0.0.1",
               MS_SCHED_PORT=str(_common.free_port()), GLOG_v="3", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p]))
    env[_OWN_LAUNCHER] = "1"
    command = [sys.executable, os.path.abspath(__file__), *argv]
    logs = tempfile.mkdtemp(prefix="hp_train_cell_")
    print(f"starting a MindSpore scheduler and {world} workers (logs: {logs})", flush=True)
    names = ["scheduler"] + [f"rank{r}" for r in range(world)]
    files = [open(os.path.join(logs, f"{name}.log"), "w") for name in names]
    procs = [subprocess.Popen(command, env={**env, "MS_ROLE": "MS_SCHED"}, stdout=files[0],
                              stderr=subprocess.STDOUT)]
    procs += [subprocess.Popen(command, env={**env, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(r)},
                               stdout=files[r + 1], stderr=subprocess.STDOUT) for r in range(world)]
    shown, code, deadline = 0, None, time.time() + timeout
    while code is None:
        time.sleep(0.3)
        shown = _show(os.path.join(logs, "rank0.log"), shown)
        codes = [p.poll() for p in procs[1:]]
        if any(c not in (None, 0) for c in codes) or time.time() > deadline:
            code = next((c for c in codes if c not in (None, 0)), 124)
        elif all(c == 0 for c in codes):
            code = 0
    for p in procs[1:] if code == 0 else procs:   # on success the scheduler ends by itself
        if p.poll() is None:
            p.terminate()
    try:
        procs[0].wait(timeout=15)
    except subprocess.TimeoutExpired:
        procs[0].kill()
    _show(os.path.join(logs, "rank0.log"), shown)
    for f in files:
        f.close()
    if not code:
        shutil.rmtree(logs, ignore_errors=True)
    else:
        for r in range(1, world):
            tail = _filtered(os.path.join(logs, f"rank{r}.log"))[-3000:]
            print(f"--- rank {r} (exit {procs[r + 1].poll()}):\n{tail}")
    return code


def _filtered(path):
    with open(path, errors="replace") as f:
        return "".join(line for line in f if not _CHATTER.match(line))


def _show(path, shown):
    text = _filtered(path)
    print(text[shown:], end="", flush=True)
    return len(text)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    role = os.environ.get("MS_ROLE")
    if role == "MS_SCHED":             # the cluster's scheduler (ours or msrun's)
        from mindspore.communication import init
        init()
        return 0
    if role or "RANK_TABLE_FILE" in os.environ:
        code = rank_main(args)
        if os.environ.get(_OWN_LAUNCHER):
            # a worker of our launcher leaves at once: MindSpore's exit hooks tear the cluster
            # client down while rank 0 still runs the one-process reference, and once crashed
            # there (SIGSEGV after a finished, correct run); the worker has nothing left to release
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    world = args.dp * args.dp_shard * args.tp
    if world == 1:
        os.environ["HP_PLATFORM"] = "mindspore"
        losses = train_single(args)
        for i, loss in enumerate(losses):
            print(f"[{i + 1}/{args.steps}] loss {loss:.6f}")
        return 0
    return launch(argv, world)


if __name__ == "__main__":
    sys.exit(main())
