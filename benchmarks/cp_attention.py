"""Context-parallel attention benchmark: ``python -m benchmarks.cp_attention``.

With no launcher environment it starts ``--nproc`` local CPU ranks itself (torch: spawned gloo
ranks; ``HP_PLATFORM=mindspore``: a MindSpore scheduler and worker processes); under torchrun or
msrun it uses the launched world (``HP_PLATFORM=npu`` for Ascend). For every mode and a
single-device reference it prints forward and forward+backward time (median), bytes sent per rank
(counted) beside the closed form, peak memory per rank, max error of the output and input
gradients against the reference, and causal work imbalance. Exit status 1 if any mode's error
exceeds the tolerance, 2 if the configuration cannot run on this framework.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

if __package__ in (None, ""):   # run as a file (msrun benchmarks/x.py): the package is at the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import rss_peak

from benchmarks import cp_packed

TOLERANCE = {"float32": 1e-4, "float64": 1e-8, "bfloat16": 3e-2, "float16": 5e-3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.cp_attention", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="local ranks to start without a launcher")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048, help="global sequence length")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (GQA); default = --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--window", type=int, default=None, metavar="W",
                   help="causal sliding window of W keys (hyper_parallel.attention); the ring's bytes shrink")
    p.add_argument("--modes", default="all", help="comma-separated mode names, or 'all'")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="write every number to this file")
    p.add_argument("--plot", default=None, help="write a PNG (needs matplotlib)")
    p.add_argument("--sweep", action="store_true", help="also time a sequence-length sweep (for --plot)")
    p.add_argument("--compare", action="store_true", help="add rows for peer implementations when importable")
    p.add_argument("--kind", default="attention", choices=("attention", "gdn"),
                   help="gdn: linear-attention rows (the gated delta rule, benchmarks/cp_linear.py)")
    p.add_argument("--calibrate", metavar="PATH", help="measure this world's numbers for mode='auto' into PATH, "
                   "then exit (ContextParallel(mode='auto', calibration=PATH) reads them)")
    p.add_argument("--auto-sweep", action="store_true", help="time auto against every fixed mode over "
                   "--sweep-heads x (kv heads 1, = heads) x --sweep-seqs x causal/full")
    p.add_argument("--sweep-heads", default="2,8", help="query heads of --auto-sweep")
    p.add_argument("--sweep-seqs", default="256,1024", help="sequence lengths of --auto-sweep")
    p.add_argument("--packed", type=int, default=0, metavar="N",
                   help="N packed documents per row: modes run under attention_masks(document_ids=...) "
                        "against a dense-mask reference (torch)")
    p.add_argument("--packed-block", type=int, default=256, help="tile size of the masked kernels (--packed)")
    args = p.parse_args(argv)
    problem = _invalid(args)
    if problem:  # one line, exit status 2, before any rank starts
        print(f"{p.prog}: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    args.kv_heads = args.kv_heads or args.heads
    return args


def _invalid(args):
    """Why the arguments cannot run (naming the value and the fix), or None."""
    positive = ("nproc", "batch", "seq", "heads", "head_dim", "iters")
    for name in positive + ("kv_heads",):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} {value}: must be a positive integer"
    if args.warmup < 0:
        return f"--warmup {args.warmup}: must be 0 or more"
    if args.window is not None and (args.window < 1 or not args.causal):
        return f"--window {args.window}: must be a positive number of keys, with --causal"
    if args.window is not None and (args.packed or args.kind != "attention"):
        return f"--window {args.window}: not with --packed or --kind {args.kind} (attention rows only)"
    if args.packed < 0 or args.packed > args.seq or args.packed_block < 1:
        return (f"--packed {args.packed} / --packed-block {args.packed_block}: documents must be 0 (off) to "
                f"--seq, the block at least 1")
    if args.kv_heads is not None and args.heads % args.kv_heads:
        return f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads} (grouped-query attention)"
    if args.modes != "all":
        names = [m.strip() for m in args.modes.split(",")]
        from benchmarks.cp_modes import MODES  # only here: it imports the framework
        known = [m.name for m in MODES] + ["auto"]
        unknown = [n for n in names if n not in known]
        if unknown:
            return f"--modes: unknown mode(s) {', '.join(map(repr, unknown))}; known: all, {', '.join(known)}"
    for flag in ("json", "plot"):
        path = getattr(args, flag)
        if path is not None:
            why = _unwritable(path)
            if why:
                return f"--{flag} {path}: cannot write there ({why})"
    return None


def _unwritable(path):
    """Why ``path`` cannot be written (probed by opening it for appending), or None."""
    if os.path.isdir(path):
        return "it is a directory"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    if not existed:
        try:
            os.remove(path)
        except OSError:  # another rank probing the same path removed it first
            pass
    return None


def main(argv=None):
    from benchmarks import cp_launch
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    platform = cp_launch.platform_name()
    role = cp_launch.role(platform)
    if role == "launcher":
        return cp_launch.start_ranks(platform, args, argv)
    if role == "scheduler":
        return cp_launch.as_child(cp_launch.run_scheduler)
    return cp_launch.as_child(lambda: rank_main(args))


def rank_main(args):
    """One rank's run; a configuration the framework cannot run is exit status 2, with the reason."""
    from benchmarks.cp_frameworks import UnsupportedConfig
    try:
        return run_rank(args)
    except UnsupportedConfig as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


# ----------------------------------------------------------------------------------------- one rank
def run_rank(args):
    from benchmarks import cp_auto
    from benchmarks.cp_frameworks import framework_ops
    from benchmarks.cp_modes import MODES
    from benchmarks.cp_ring_overlap import format_line, ring_overlap_line
    from benchmarks.cp_report import format_notes, header, notes, plot, table, write_json
    from hyper_parallel import init_device_mesh
    from hyper_parallel.platform import get_platform

    platform = get_platform()
    fw = framework_ops(platform, args.dtype)
    fw.check_dtype()  # before joining the world: a dtype without kernels fails fast, named
    platform.init_process_group()
    rank, world = platform.get_rank(), platform.get_world_size()
    fw.set_threads(world)
    mesh = init_device_mesh(platform.device_type, (world,))
    if args.kind == "gdn":
        from benchmarks import cp_linear
        return cp_linear.run(args, mesh, platform)
    lead = rank == 0
    if lead:
        print(header(args, world, platform.name, platform.capabilities()), flush=True)

    if args.calibrate:
        code = cp_auto.calibrate(args.calibrate, mesh, lead)
        # a gloo rank that exits with its group alive sometimes aborts ("terminate called without an
        # active exception"): tear down (a barrier first) as every other path does
        platform.destroy_process_group()
        return code
    if args.auto_sweep:
        sweep = cp_auto.auto_sweep(args, lambda cfg: _Bench(cfg, mesh, platform, fw), lead)
        if lead and args.json:
            write_json(args.json, {"auto_sweep": sweep, "world": world, "config": vars(args)})
        platform.destroy_process_group()
        return 1 if any(r["err"] > TOLERANCE[args.dtype] for r in sweep) else 0
    peers, no_peers = _peers(args, fw)
    wanted = [m.strip() for m in args.modes.split(",")]
    modes = [m for m in MODES if args.modes == "all" or m.name in wanted] + peers
    if "auto" in wanted:
        modes.append(cp_auto.AutoMode())
    bench = _Bench(args, mesh, platform, fw)
    rows = [bench.reference()]
    for i, mode in enumerate(modes):
        if lead:
            print(f"[{i + 1}/{len(modes)}] {mode.name} ...", file=sys.stderr, flush=True)
        rows.append(bench.run(mode))
        if isinstance(mode, cp_auto.AutoMode) and mode.style is not None and mode.style.last_choice:
            rows[-1]["mode"] = f"auto -> {mode.style.last_choice.mode}"
    rows += no_peers
    ring_row = next((r for r in rows if r["mode"] == "ring"), None)
    ring_line = ring_overlap_line(bench, ring_row) if fw.name == "torch" else None
    sweep = bench.sweep(modes) if args.sweep else []
    failed = [r["mode"] for r in rows if not r.get("skipped") and not r["ok"]]
    if lead:
        remarks = notes(rows, platform.capabilities(), fw)
        print("\n".join([table(rows)] + format_line(ring_line) + format_notes(remarks)), flush=True)
        payload = {"title": f"CP attention, world {world}, S={args.seq}", "world": world,
                   "platform": platform.name, "capabilities": platform.capabilities(), "config": vars(args),
                   "rows": rows, "ring_overlap": ring_line,
                   "notes": remarks, "sweep": sweep, "tolerance": TOLERANCE[args.dtype]}
        if args.json:
            write_json(args.json, payload)
        if args.plot:
            plot(args.plot, payload)
        if failed:
            print(f"ERROR: error above tolerance {TOLERANCE[args.dtype]:g} in: {', '.join(failed)}", flush=True)
    platform.destroy_process_group()
    return 1 if failed else 0


def _peers(args, fw):
    """``--compare``: (peer modes, []) on torch; elsewhere ([], [a skipped row saying why])."""
    if not args.compare:
        return [], []
    if fw.name != "torch":
        return [], [{"mode": "--compare peers", "skipped": "the peers (DeepSpeed, PyTorch DTensor and ring) "
                                                           f"are torch-only; platform is {fw.name}"}]
    from benchmarks.cp_peers import available_peers
    return available_peers(args), []


class _Bench:
    """Runs the reference and each mode on this rank; every number in a row is agreed across ranks."""

    def __init__(self, args, mesh, platform, fw):
        self.args, self.mesh, self.platform, self.fw = args, mesh, platform, fw
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self._make_inputs(args.seq)

    def _make_inputs(self, seq):
        a = self.args
        rng = np.random.RandomState(0)  # numpy, so that every framework sees the same numbers
        shape_q, shape_kv = (a.batch, seq, a.heads, a.head_dim), (a.batch, seq, a.kv_heads, a.head_dim)
        self.full = [self.fw.tensor(rng.standard_normal(s).astype(np.float32))
                     for s in (shape_q, shape_kv, shape_kv)]
        self.grad_out = self.fw.tensor(rng.standard_normal(shape_q).astype(np.float32))
        self.seq = seq
        self.ref = None

    def _block(self, t):
        L = self.seq // self.world
        return self.fw.block(t, 1, self.rank * L, L)

    def _reduce(self, value, op):
        """``value`` reduced over the ranks; None (not measurable here, on every rank) stays None."""
        if value is None:
            return None
        out = self.platform.all_reduce(self.fw.scalar(value), None, op)
        return float(self.fw.to_numpy(out)[0])

    def _imbalance(self, mode):
        work = self.fw.scalar(mode.causal_work(self.args, self.world, self.rank))
        works = self.fw.to_numpy(self.platform.all_gather(work, None, 0))
        return float(works.max() / works.min())

    def _peak(self, fn, here=True):
        """Peak bytes allocated while ``fn`` runs (0 where not ``here``), or None on every rank where
        the framework cannot tell."""
        if self.fw.peak_memory_unsupported:
            return None
        if not here:
            return 0
        if self.platform.device_type == "cpu" and rss_peak.available():
            # the process's RSS high-water mark (kernel-internal buffers count too), or the storages
            # created where a small run fits in pages already resident (RSS then does not rise)
            with self.platform.track_peak_memory() as mem:
                rss = rss_peak.rss_peak_bytes(lambda: (fn(), self.platform.synchronize()))
            return max(rss, mem.peak_bytes)
        with self.platform.track_peak_memory() as mem:
            fn()
            self.platform.synchronize()
        return mem.peak_bytes

    def _time(self, fn):
        samples = []
        for i in range(self.args.warmup + self.args.iters):
            self.platform.barrier()
            self.platform.synchronize()
            start = time.perf_counter()
            fn()
            self.platform.synchronize()  # MindSpore (and accelerators) run ops asynchronously
            if i >= self.args.warmup:
                samples.append((time.perf_counter() - start) * 1e3)
        return self._reduce(statistics.median(samples), "max")

    def _time_alone(self, fn):
        """Median ms of ``fn`` on rank 0 while the others wait (one barrier per iteration keeps every
        wait short). Where waiting ranks would spin or time out (``fw.solo_timing_unsupported``)
        every rank times its own copy at once instead, and the slowest counts."""
        alone = not self.fw.solo_timing_unsupported
        samples = []
        for i in range(self.args.warmup + self.args.iters):
            if self.rank == 0 or not alone:
                self.platform.synchronize()
                start = time.perf_counter()
                fn()
                self.platform.synchronize()
                if i >= self.args.warmup:
                    samples.append((time.perf_counter() - start) * 1e3)
            if alone:
                self.platform.barrier()
        return self._reduce(statistics.median(samples) if samples else 0.0, "max")

    def reference(self):
        fw = self.fw
        module = fw.attention(self.args.causal, self.args.kv_heads != self.args.heads, self.args.window)
        if self.args.packed:
            module = cp_packed.reference(self.args, fw)
        self.ref = fw.forward_backward(module, self.full, self.grad_out)
        # timed on one process alone where possible, as on a single device
        fwd = self._time_alone(lambda: fw.forward(module, self.full))
        fwd_bwd = self._time_alone(lambda: fw.forward_backward(module, self.full, self.grad_out))
        peak = self._peak(lambda: fw.forward_backward(module, self.full, self.grad_out), here=self.rank == 0)
        self.platform.barrier()
        return {"mode": "reference (1 device)", "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "bytes_fwd": 0,
                "bytes_fwd_bwd": 0, "formula_bytes": 0, "peak_mem_bytes": self._reduce(peak, "max"),
                "err_out": 0.0, "err_grad": 0.0, "imbalance": 1.0, "ok": True}

    def run(self, mode):
        from hyper_parallel.core.comm_mode import CommDebugMode
        fw, a = self.fw, self.args
        why_not = mode.supported(a, self.world, fw) or (a.packed and cp_packed.skip_reason(a, mode))
        if why_not:
            return {"mode": mode.name, "skipped": why_not}
        attn = mode.build(a, self.mesh, fw)
        if a.packed:
            attn = cp_packed.packed(attn, a, fw)
        blocks = [self._block(t) for t in self.full]
        grad_block = self._block(self.grad_out)

        def forward_backward():
            return fw.forward_backward(attn, blocks, grad_block)

        if getattr(mode, "warm_up_before_counting", False):
            fw.forward(attn, blocks)
        with CommDebugMode() as comm:
            out = fw.forward(attn, blocks)
        sent_fwd = sum(b for op, b in comm.get_comm_bytes().items() if op not in ("shape_check", "calibration"))
        if getattr(mode, "forward_only", False):
            return self._run_forward_only(mode, attn, blocks, out, sent_fwd)
        with CommDebugMode() as comm:
            out, grads = forward_backward()
        sent_all = sum(b for op, b in comm.get_comm_bytes().items() if op not in ("shape_check", "calibration"))
        ref_out, ref_grads = self.ref
        err_out = fw.max_abs_diff(out, self._block(ref_out))
        err_grad = max(fw.max_abs_diff(g, self._block(r)) for g, r in zip(grads, ref_grads))
        peak = self._peak(forward_backward)
        fwd = self._time(lambda: fw.forward(attn, blocks))
        fwd_bwd = self._time(forward_backward)
        err_out, err_grad = self._reduce(err_out, "max"), self._reduce(err_grad, "max")
        return {"mode": mode.name, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd,
                "bytes_fwd": self._reduce(sent_fwd, "max"), "bytes_fwd_bwd": self._reduce(sent_all, "max"),
                "formula_bytes": mode.formula_elements(a, self.world) * fw.element_size(),
                "peak_mem_bytes": self._reduce(peak, "max"), "err_out": err_out, "err_grad": err_grad,
                "imbalance": self._imbalance(mode), "ok": max(err_out, err_grad) <= TOLERANCE[a.dtype]}

    def _run_forward_only(self, mode, attn, blocks, out, sent_fwd):
        """A row for a peer that has no backward here: forward time, bytes, memory and error only."""
        fw, a = self.fw, self.args
        err_out = self._reduce(fw.max_abs_diff(out, self._block(self.ref[0])), "max")
        peak = self._peak(lambda: fw.forward(attn, blocks))
        fwd = self._time(lambda: fw.forward(attn, blocks))
        return {"mode": f"{mode.name} (fwd only)", "fwd_ms": fwd, "fwd_bwd_ms": None,
                "bytes_fwd": self._reduce(sent_fwd, "max"), "bytes_fwd_bwd": None,
                "formula_bytes": mode.formula_elements(a, self.world) * fw.element_size(),
                "peak_mem_bytes": self._reduce(peak, "max"), "err_out": err_out, "err_grad": None,
                "imbalance": self._imbalance(mode), "ok": err_out <= TOLERANCE[a.dtype]}

    def sweep(self, modes):
        points = []
        full_seq = self.args.seq
        for seq in (full_seq // 4, full_seq // 2, full_seq):
            self._make_inputs(seq)
            self.reference()
            for mode in modes:
                self.args.seq = seq
                row = self.run(mode)
                if not row.get("skipped") and row["fwd_bwd_ms"] is not None:
                    points.append({"mode": mode.name, "seq": seq, "fwd_bwd_ms": row["fwd_bwd_ms"]})
        self.args.seq = full_seq
        return points


if __name__ == "__main__":
    if not __package__:  # run as a file (msrun takes a script path): make ``benchmarks`` importable
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
