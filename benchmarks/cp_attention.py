"""Context-parallel attention benchmark: ``python -m benchmarks.cp_attention``.

With no launcher environment it spawns ``--nproc`` local CPU ranks (gloo); under torchrun it uses
the launched world (``HP_PLATFORM=npu`` for Ascend). For every mode and a single-device reference
it prints forward and forward+backward time (median), bytes sent per rank (counted) beside the
closed form, peak memory per rank, max error of the output and input gradients against the
reference, and causal work imbalance. Exit status 1 if any mode's error exceeds the tolerance.
"""
import argparse
import os
import socket
import statistics
import sys
import time

TOLERANCE = {"float32": 1e-4, "float64": 1e-8, "bfloat16": 3e-2, "float16": 5e-3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.cp_attention", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="local ranks to spawn without a launcher")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048, help="global sequence length")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (GQA); default = --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--modes", default="all", help="comma-separated mode names, or 'all'")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="write every number to this file")
    p.add_argument("--plot", default=None, help="write a PNG (needs matplotlib)")
    p.add_argument("--sweep", action="store_true", help="also time a sequence-length sweep (for --plot)")
    p.add_argument("--compare", action="store_true", help="add rows for peer implementations when importable")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    return args


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_rank(args)
    import torch.multiprocessing as mp
    port = _free_port()
    print(f"spawning {args.nproc} local ranks (no launcher environment found)", file=sys.stderr, flush=True)
    context = mp.start_processes(_spawned, args=(args, port), nprocs=args.nproc, join=False, start_method="spawn")
    try:
        while not context.join():
            pass
    except Exception as exc:  # a rank failed or exited non-zero
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _spawned(rank, args, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    code = run_rank(args)
    if code:
        sys.exit(code)


# ----------------------------------------------------------------------------------------- one rank
def run_rank(args):
    import torch
    from benchmarks.cp_modes import MODES
    from benchmarks.cp_report import header, plot, table, write_json
    from hyper_parallel import init_device_mesh
    from hyper_parallel.platform import get_platform

    platform = get_platform()
    platform.init_process_group()
    rank, world = platform.get_rank(), platform.get_world_size()
    if platform.device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh(platform.device_type, (world,))
    args.dtype_obj = getattr(torch, args.dtype)
    lead = rank == 0
    if lead:
        print(header(args, world, platform.name, platform.capabilities()), flush=True)

    modes = [m for m in MODES if args.modes == "all" or m.name in args.modes.split(",")]
    modes += _peers(args) if args.compare else []
    bench = _Bench(args, mesh, platform)
    rows = [bench.reference()]
    for i, mode in enumerate(modes):
        if lead:
            print(f"[{i + 1}/{len(modes)}] {mode.name} ...", file=sys.stderr, flush=True)
        rows.append(bench.run(mode))
    sweep = bench.sweep(modes) if args.sweep else []
    failed = [r["mode"] for r in rows if not r.get("skipped") and not r["ok"]]
    if lead:
        print(table(rows), flush=True)
        payload = {"title": f"CP attention, world {world}, S={args.seq}", "world": world,
                   "platform": platform.name, "capabilities": platform.capabilities(),
                   "config": {k: v for k, v in vars(args).items() if k != "dtype_obj"}, "rows": rows,
                   "sweep": sweep, "tolerance": TOLERANCE[args.dtype]}
        if args.json:
            write_json(args.json, payload)
        if args.plot:
            plot(args.plot, payload)
        if failed:
            print(f"ERROR: error above tolerance {TOLERANCE[args.dtype]:g} in: {', '.join(failed)}", flush=True)
    platform.destroy_process_group()
    return 1 if failed else 0


def _peers(args):
    from benchmarks.cp_peers import available_peers
    return available_peers(args)


class _Bench:
    def __init__(self, args, mesh, platform):
        import torch
        self.torch, self.args, self.mesh, self.platform = torch, args, mesh, platform
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        self._make_inputs(args.seq)

    def _make_inputs(self, seq):
        torch, a = self.torch, self.args
        gen = torch.Generator().manual_seed(0)
        device = self.platform.device()
        shape_q, shape_kv = (a.batch, seq, a.heads, a.head_dim), (a.batch, seq, a.kv_heads, a.head_dim)
        self.full = [torch.randn(s, generator=gen).to(device=device, dtype=a.dtype_obj)
                     for s in (shape_q, shape_kv, shape_kv)]
        self.grad_out = torch.randn(shape_q, generator=gen).to(device=device, dtype=a.dtype_obj)
        self.seq = seq
        self.ref = None

    def _block(self, t):
        L = self.seq // self.world
        return t.narrow(1, self.rank * L, L)

    def _reduce(self, value, op):
        out = self.platform.all_reduce(self.torch.tensor([float(value)]), None, op)
        return float(out.item())

    def _time(self, fn):
        samples = []
        for i in range(self.args.warmup + self.args.iters):
            self.platform.barrier()
            self.platform.synchronize()
            start = time.perf_counter()
            fn()
            self.platform.synchronize()
            if i >= self.args.warmup:
                samples.append((time.perf_counter() - start) * 1e3)
        return self._reduce(statistics.median(samples), "max")

    def reference(self):
        from benchmarks.cp_modes import Attention
        torch, a = self.torch, self.args
        module = Attention(a.causal, a.kv_heads != a.heads)
        q, k, v = (t.detach().clone().requires_grad_() for t in self.full)
        out = module(q, k, v)
        out.backward(self.grad_out)
        self.ref = (out.detach(), [t.grad for t in (q, k, v)])
        fwd = fwd_bwd = 0.0
        if self.rank == 0:  # one process alone, as on a single device
            with torch.no_grad():
                fwd = self._time_local(lambda: module(*self.full))
            fwd_bwd = self._time_local(lambda: module(*[t.detach().requires_grad_() for t in self.full])
                                       .backward(self.grad_out))
            with self.platform.track_peak_memory() as mem:
                module(*[t.detach().requires_grad_() for t in self.full]).backward(self.grad_out)
        self.platform.barrier()
        return {"mode": "reference (1 device)", "fwd_ms": self._reduce(fwd, "max"),
                "fwd_bwd_ms": self._reduce(fwd_bwd, "max"), "bytes_fwd": 0, "bytes_fwd_bwd": 0, "formula_bytes": 0,
                "peak_mem_bytes": self._reduce(mem.peak_bytes if self.rank == 0 else 0, "max"), "err_out": 0.0,
                "err_grad": 0.0, "imbalance": 1.0, "ok": True}

    def _time_local(self, fn):
        samples = []
        for i in range(self.args.warmup + self.args.iters):
            start = time.perf_counter()
            fn()
            if i >= self.args.warmup:
                samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    def run(self, mode, record=True):
        from hyper_parallel.core.comm_mode import CommDebugMode
        torch, a = self.torch, self.args
        why_not = mode.supported(a, self.world)
        if why_not:
            return {"mode": mode.name, "skipped": why_not}
        attn = mode.build(a, self.mesh)
        blocks = [self._block(t).contiguous() for t in self.full]
        grad_block = self._block(self.grad_out).contiguous()

        def forward_backward():
            inputs = [t.detach().requires_grad_() for t in blocks]
            out = attn(*inputs)
            out.backward(grad_block)
            return out, inputs

        with CommDebugMode() as comm:
            out = attn(*[t.detach().requires_grad_() for t in blocks])
        sent_fwd = sum(b for op, b in comm.get_comm_bytes().items() if op != "shape_check")
        if getattr(mode, "forward_only", False):
            return self._run_forward_only(mode, attn, blocks, out, sent_fwd)
        with CommDebugMode() as comm:
            out, inputs = forward_backward()
        sent_all = sum(b for op, b in comm.get_comm_bytes().items() if op != "shape_check")
        ref_out, ref_grads = self.ref
        err_out = (out.detach().float() - self._block(ref_out).float()).abs().max().item()
        err_grad = max((t.grad.float() - self._block(g).float()).abs().max().item()
                       for t, g in zip(inputs, ref_grads))
        with self.platform.track_peak_memory() as mem:
            forward_backward()
        with torch.no_grad():
            fwd = self._time(lambda: attn(*blocks))
        fwd_bwd = self._time(forward_backward)
        work = self.torch.tensor([mode.causal_work(a, self.world, self.rank)])
        works = self.platform.all_gather(work, None, 0)
        err_out, err_grad = self._reduce(err_out, "max"), self._reduce(err_grad, "max")
        element = self.full[0].element_size()
        return {"mode": mode.name, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd,
                "bytes_fwd": self._reduce(sent_fwd, "max"), "bytes_fwd_bwd": self._reduce(sent_all, "max"),
                "formula_bytes": mode.formula_elements(a, self.world) * element,
                "peak_mem_bytes": self._reduce(mem.peak_bytes, "max"), "err_out": err_out, "err_grad": err_grad,
                "imbalance": float(works.max() / works.min()),
                "ok": max(err_out, err_grad) <= TOLERANCE[a.dtype]}

    def _run_forward_only(self, mode, attn, blocks, out, sent_fwd):
        """A row for a peer that has no backward here: forward time, bytes, memory and error only."""
        torch, a = self.torch, self.args
        err_out = (out.detach().float() - self._block(self.ref[0]).float()).abs().max().item()
        with torch.no_grad():
            with self.platform.track_peak_memory() as mem:
                attn(*blocks)
            fwd = self._time(lambda: attn(*blocks))
        work = self.torch.tensor([mode.causal_work(a, self.world, self.rank)])
        works = self.platform.all_gather(work, None, 0)
        err_out = self._reduce(err_out, "max")
        return {"mode": f"{mode.name} (fwd only)", "fwd_ms": fwd, "fwd_bwd_ms": None,
                "bytes_fwd": self._reduce(sent_fwd, "max"), "bytes_fwd_bwd": None,
                "formula_bytes": mode.formula_elements(a, self.world) * self.full[0].element_size(),
                "peak_mem_bytes": self._reduce(mem.peak_bytes, "max"), "err_out": err_out, "err_grad": None,
                "imbalance": float(works.max() / works.min()), "ok": err_out <= TOLERANCE[a.dtype]}

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
    sys.exit(main())
