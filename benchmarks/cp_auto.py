"""``mode="auto"`` in the CP benchmark: the ``auto`` row, ``--calibrate PATH`` and ``--auto-sweep``.

``auto`` runs ``ContextParallel(mode="auto")``; its row is named after the mode it chose, and its
closed-form bytes and causal work are that mode's. ``--auto-sweep`` runs, for every configuration of
``--sweep-heads`` × (kv heads 1 and = heads) × ``--sweep-seqs`` × causal / not, each fixed mode and
``auto`` timed round-robin (interleaved), and prints per configuration the choice, the best fixed
mode's time and auto's ratio to it, auto's error against one device, then how often auto was within
1.10× of the best and whether it ever chose the slowest: judged by the chosen mode's time in the
same rounds (the decision), and by auto's own time (the decision plus the noise between two timings
of one mode). The sweep exits non-zero if auto's error exceeds the tolerance.
"""
import copy
import statistics
import sys
import time

from benchmarks.cp_modes import MODES, SEQ, HEAD, Mode

FIXED = ("ulysses", "allgather", "allgather-lb", "hybrid", "ring", "ring-zigzag", "hybrid-ring")


class AutoMode(Mode):
    # the first call of a shape chooses (the close candidates timed on it): one-time traffic that is
    # not the chosen mode's, so the bytes are counted from the second call on
    warm_up_before_counting = True

    def __init__(self):
        super().__init__("auto", None, False, False)
        self.style = None

    def supported(self, cfg, world, fw):
        return None

    def build(self, cfg, mesh, fw):
        from hyper_parallel import ContextParallel
        module = fw.attention(cfg.causal, cfg.kv_heads != cfg.heads, getattr(cfg, "window", None))
        from hyper_parallel.core.context_parallel.auto.calibration import machine_for
        self.style = ContextParallel(seq_dim=SEQ, head_dim=HEAD, mode="auto", causal=cfg.causal)
        self.style.apply(module, mesh)
        machine_for(mesh, None, self.style.fixed)   # calibrated once per mesh, before anything is counted
        return module

    def chosen(self, world):
        """The fixed benchmark mode equal to auto's last choice."""
        kw = self.style.last_choice.kwargs
        ds, ring, lb = kw["ulysses_degree"], kw["kv_exchange"] == "ring", kw["load_balance"]
        if ds == world:
            name = "ulysses"
        elif ds == 1:
            name = ("ring" if ring else "allgather") + ("-zigzag" if ring and lb else "-lb" if lb else "")
        else:
            return Mode("hybrid-ring" if ring else "hybrid", ds, False, False, kw["kv_exchange"])
        return next(m for m in MODES if m.name == name)

    def formula_elements(self, cfg, world):
        return self.chosen(world).formula_elements(cfg, world)

    def causal_work(self, cfg, world, rank):
        return self.chosen(world).causal_work(cfg, world, rank)


def calibrate(path, mesh, lead):
    from hyper_parallel import ContextParallel
    from hyper_parallel.core.context_parallel.auto.calibration import measure
    machine = measure(mesh, make_style=ContextParallel(mode="auto").fixed)
    if lead:
        machine.save(path)
        print(f"calibration of {mesh.size()} ranks written to {path}: {machine}", flush=True)
    return 0


def _configs(args):
    heads = [int(h) for h in args.sweep_heads.split(",")]
    seqs = [int(s) for s in args.sweep_seqs.split(",")]
    for h in heads:
        for kv in sorted({1, h}):
            for s in seqs:
                for causal in (True, False):
                    yield {"heads": h, "kv_heads": kv, "seq": s, "causal": causal}


def _prepare(bench, mode):
    """The fwd+bwd closure of ``mode`` on this rank's blocks, or None where it cannot run here."""
    if mode.supported(bench.args, bench.world, bench.fw):
        return None
    attn = mode.build(bench.args, bench.mesh, bench.fw)
    blocks = [bench._block(t) for t in bench.full]
    grad_block = bench._block(bench.grad_out)
    return lambda: bench.fw.forward_backward(attn, blocks, grad_block)


def _interleaved(bench, fns):
    """Median fwd+bwd ms of each closure, timed round-robin: every round runs each once, so a change
    of load on a shared machine hits them alike; the slowest rank's median."""
    platform, samples = bench.platform, {name: [] for name in fns}
    for i in range(bench.args.warmup + bench.args.iters):
        for name, fn in fns.items():
            platform.barrier()
            platform.synchronize()
            start = time.perf_counter()
            fn()
            platform.synchronize()
            if i >= bench.args.warmup:
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: bench._reduce(statistics.median(s), "max") for name, s in samples.items()}


def _exact(bench, fn):
    """auto's largest error (output and input gradients) against the one-device reference."""
    out, grads = fn()
    ref_out, ref_grads = bench.ref
    err = max([bench.fw.max_abs_diff(out, bench._block(ref_out))] +
              [bench.fw.max_abs_diff(g, bench._block(r)) for g, r in zip(grads, ref_grads)])
    return bench._reduce(err, "max")


def auto_sweep(args, make_bench, lead):
    """Rows of the sweep (see the module docstring); prints as it goes on the lead rank."""
    results = []
    for config in _configs(args):
        cfg = copy.copy(args)
        for k, v in config.items():
            setattr(cfg, k, v)
        bench = make_bench(cfg)
        bench.reference()
        fns = {m.name: fn for m in MODES if m.name in FIXED and (fn := _prepare(bench, m)) is not None}
        auto = AutoMode()
        fns["auto"] = _prepare(bench, auto)
        err = _exact(bench, fns["auto"])
        times = _interleaved(bench, fns)
        auto_ms = times.pop("auto")
        best = min(times, key=times.get)
        # the chosen mode's own time in the same rounds: the decision's quality (auto's own time
        # differs from it by the noise between two timings of one mode)
        chosen_ms = times.get(auto.chosen(bench.world).name, auto_ms)
        result = dict(config, choice=auto.style.last_choice.mode, auto_ms=auto_ms, best=best,
                      best_ms=times[best], ratio=auto_ms / times[best], choice_ratio=chosen_ms / times[best],
                      slowest=chosen_ms >= max(times.values()) and len(times) > 1, err=err, times=times)
        results.append(result)
        if lead:
            print(f"H={config['heads']:>3} Hkv={config['kv_heads']:>3} S={config['seq']:>6} "
                  f"{'causal' if config['causal'] else 'full  '} auto -> {result['choice']:<18} "
                  f"{auto_ms:9.2f} ms | best {best:<13} {result['best_ms']:9.2f} ms | "
                  f"ratio {result['ratio']:.2f} (chosen mode's time {result['choice_ratio']:.2f}) err {err:.1e}",
                  file=sys.stderr, flush=True)
            print(f"    why: {auto.style.last_choice}", file=sys.stderr, flush=True)
    if lead and results:
        n = len(results)
        chose = sum(r["choice_ratio"] <= 1.10 for r in results)
        within = sum(r["ratio"] <= 1.10 for r in results)
        print(f"auto's choice within 1.10x of the best fixed mode (their times in this run): {chose}/{n} "
              f"({100 * chose / n:.0f} %); auto's own row within 1.10x: {within}/{n} ({100 * within / n:.0f} %); "
              f"chose the slowest: {sum(r['slowest'] for r in results)} times", flush=True)
    return results
