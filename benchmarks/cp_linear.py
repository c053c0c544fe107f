"""Linear-attention rows of the CP benchmark: ``python -m benchmarks.cp_attention --kind gdn``.

The gated delta rule (Gated DeltaNet: a decay per head; ``--heads`` value heads, ``--kv-heads`` q/k
heads, ``--head-dim`` for d_k and d_v) on each rank's sequence block, in both state modes, against
the single-device chunked rule on the whole sequence: forward and forward+backward time, bytes
sent per rank in forward beside the closed form, peak memory, max error of the output and of the
q/k/v/g/beta gradients. Closed forms, per rank, elements of the dtype (B batch, H value heads):
  allgather  forward: (P − 1) · B · H · d_k · (d_k + d_v)   (one all-gather of the [M | S] summaries;
             backward: the same in one reduce-scatter)
  p2p        forward: B · H · d_k · d_v                     (one hop of the state; backward one hop back)
Neither depends on the sequence length. torch only (the benchmark's tensors; the rule itself is
framework-neutral).
"""
import statistics
import time

import numpy as np

from benchmarks import rss_peak
from benchmarks.cp_report import human_bytes, table

MODES = ("allgather", "p2p")
TOLERANCE = {"float32": 1e-4, "float64": 1e-8}


def formula_elements(mode, args, world):
    d = args.head_dim
    if mode == "allgather":
        return (world - 1) * args.batch * args.heads * d * (2 * d)
    return args.batch * args.heads * d * d if world > 1 else 0


class _LinearBench:
    def __init__(self, args, mesh, platform):
        import torch
        self.torch, self.args, self.mesh, self.platform = torch, args, mesh, platform
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        dtype = getattr(torch, args.dtype)
        rng = np.random.RandomState(0)
        b, s, d = args.batch, args.seq, args.head_dim

        def rnd(*shape):
            return torch.tensor(rng.standard_normal(shape), dtype=dtype)
        sig = torch.nn.functional.logsigmoid
        self.full = [rnd(b, s, args.kv_heads, d), rnd(b, s, args.kv_heads, d), rnd(b, s, args.heads, d),
                     sig(rnd(b, s, args.heads)) * 0.1, torch.sigmoid(rnd(b, s, args.heads))]
        self.grad_out = rnd(b, s, args.heads, d)

    def _block(self, t):
        length = self.args.seq // self.world
        return t[:, self.rank * length:(self.rank + 1) * length]

    def _fwd_bwd(self, fn, inputs, grad_out):
        leaves = [x.detach().requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(grad_out)
        return out.detach(), [x.grad for x in leaves]

    def _reduce(self, value, op):
        out = self.platform.all_reduce(self.torch.tensor([float(value)], dtype=self.torch.float64), None, op)
        return float(out[0])

    def _time(self, fn):
        samples = []
        for i in range(self.args.warmup + self.args.iters):
            self.platform.barrier()
            start = time.perf_counter()
            fn()
            if i >= self.args.warmup:
                samples.append((time.perf_counter() - start) * 1e3)
        return self._reduce(statistics.median(samples), "max")

    def _peak(self, fn):
        if not rss_peak.available():
            return None
        return self._reduce(rss_peak.rss_peak_bytes(fn), "max")

    def reference(self):
        from hyper_parallel.core.context_parallel.linear_attention import chunk_delta_rule

        def rule(*xs):
            return chunk_delta_rule(*xs)[0]
        self.ref = self._fwd_bwd(rule, self.full, self.grad_out)
        fwd = self._time(lambda: rule(*self.full))
        fwd_bwd = self._time(lambda: self._fwd_bwd(rule, self.full, self.grad_out))
        return {"mode": "reference (1 device)", "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "bytes_fwd": 0,
                "formula_bytes": 0, "peak_mem_bytes": self._peak(lambda: self._fwd_bwd(rule, self.full,
                                                                                          self.grad_out)),
                "err_out": 0.0, "err_grad": 0.0, "imbalance": 1.0, "ok": True}

    def run(self, mode):
        from hyper_parallel.core.comm_mode import CommDebugMode
        from hyper_parallel.core.context_parallel.linear_attention import context_parallel_delta_rule

        def rule(*xs):
            return context_parallel_delta_rule(*xs, self.mesh, mode=mode)
        blocks, grad_block = [self._block(t) for t in self.full], self._block(self.grad_out)
        with CommDebugMode() as comm:
            rule(*blocks)
        # the data the exchange moves; the first call's cross-rank check of the settings is not part of it
        sent = sum(b for op, b in comm.get_comm_bytes().items() if op != "shape_check")
        out, grads = self._fwd_bwd(rule, blocks, grad_block)
        err_out = float((out - self._block(self.ref[0])).abs().max())
        err_grad = max(float((g - self._block(r)).abs().max()) for g, r in zip(grads, self.ref[1]))
        err_out, err_grad = self._reduce(err_out, "max"), self._reduce(err_grad, "max")
        return {"mode": f"gdn {mode}", "fwd_ms": self._time(lambda: rule(*blocks)),
                "fwd_bwd_ms": self._time(lambda: self._fwd_bwd(rule, blocks, grad_block)),
                "bytes_fwd": self._reduce(sent, "max"),
                "formula_bytes": formula_elements(mode, self.args, self.world) * self.full[0].element_size(),
                "peak_mem_bytes": self._peak(lambda: self._fwd_bwd(rule, blocks, grad_block)),
                "err_out": err_out, "err_grad": err_grad, "imbalance": 1.0,
                "ok": max(err_out, err_grad) <= TOLERANCE[self.args.dtype]}


def run(args, mesh, platform):
    """All rows on this rank; rank 0 prints the table. Exit status 1 if an error exceeds the tolerance."""
    if platform.name != "torch" or args.seq % mesh.size() or args.dtype not in TOLERANCE:
        if mesh.get_local_rank() == 0:
            print(f"error: --kind gdn runs on torch, --dtype float32 or float64, --seq a multiple of the world "
                  f"(got {platform.name}, {args.dtype}, {args.seq} over {mesh.size()} ranks)", flush=True)
        return 2
    bench = _LinearBench(args, mesh, platform)
    rows = [bench.reference()] + [bench.run(mode) for mode in MODES]
    failed = [r["mode"] for r in rows if not r["ok"]]
    if mesh.get_local_rank() == 0:
        print(f"hyper_parallel CP linear attention (gated delta rule) — world {mesh.size()}\n"
              f"B={args.batch} S={args.seq} H={args.heads} Hk={args.kv_heads} d_k=d_v={args.head_dim} "
              f"dtype={args.dtype} chunk=64 iters={args.iters}", flush=True)
        print(table(rows), flush=True)
        per_head = formula_elements("allgather", args, mesh.size()) // (args.batch * args.heads)
        print(f"note: bytes are the forward's; backward sends the same again (allgather: a reduce-scatter of "
              f"the summaries' gradients, p2p: one hop back). allgather per head and rank: "
              f"{human_bytes(per_head * bench.full[0].element_size())}, whatever S is.", flush=True)
        if failed:
            print(f"ERROR: error above tolerance {TOLERANCE[args.dtype]:g} in: {', '.join(failed)}", flush=True)
    platform.destroy_process_group()
    return 1 if failed else 0
