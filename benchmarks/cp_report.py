"""Printing, JSON and plots for the context-parallel benchmark."""
import json
import os
import textwrap

# (title, width, formatter)
COLUMNS = [("mode", 20, str), ("fwd ms", 8, "{:.2f}".format), ("fwd+bwd ms", 10, "{:.2f}".format),
           ("sent/rank", 10, None), ("formula", 10, None), ("peak mem", 10, None),
           ("err out", 8, "{:.1e}".format), ("err grad", 8, "{:.1e}".format), ("imbalance", 9, "{:.2f}".format)]


def human_bytes(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def header(cfg, world, platform_name, capabilities):
    lines = [f"hyper_parallel CP attention benchmark — platform {platform_name}, "
             f"backend {capabilities.get('backend')}, world {world}",
             f"B={cfg.batch} S={cfg.seq} Hq={cfg.heads} Hkv={cfg.kv_heads} D={cfg.head_dim} "
             f"dtype={cfg.dtype} causal={cfg.causal} iters={cfg.iters} warmup={cfg.warmup}"]
    emulated = [f"{k}: {v}" for k, v in capabilities.items() if str(v).startswith("emulated")]
    if emulated:
        lines.append("emulated collectives: " + "; ".join(emulated))
    return "\n".join(lines)


def table(rows):
    def line(cells):
        return " ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, (_, w, _)) in enumerate(zip(cells, COLUMNS)))
    out = [line([name for name, _, _ in COLUMNS])]
    out.append("-" * len(out[0]))
    for row in rows:
        if row.get("skipped"):
            out.append(f"{row['mode']:<20s} skipped: {row['skipped']}")
            continue
        values = [row["mode"], row["fwd_ms"], row["fwd_bwd_ms"], row["bytes_fwd"], row["formula_bytes"],
                  row["peak_mem_bytes"], row["err_out"], row["err_grad"], row["imbalance"]]
        out.append(line([("-" if v is None else fmt(v)) if fmt else human_bytes(v)
                         for v, (_, _, fmt) in zip(values, COLUMNS)]))
    return "\n".join(out)


def notes(rows, capabilities, fw):
    """Lines printed under the table where its numbers need a word of explanation."""
    out = []
    emulated = sorted(k for k, v in capabilities.items() if str(v).startswith("emulated"))
    above = [r["mode"] for r in rows if not r.get("skipped") and r.get("formula_bytes")
             and r["bytes_fwd"] > r["formula_bytes"] * (1 + 1e-9)]
    if above:
        cause = (f"this platform emulates {', '.join(emulated)} with all-gather / all-reduce (see the "
                 "header), which sends more than a native collective" if emulated
                 else "more traffic than the plan needs")
        out.append(f"note: sent/rank exceeds the formula (its closed form assumes native collectives) in "
                   f"{', '.join(above)}: {cause}.")
    if fw.solo_timing_unsupported:
        out.append(f"note: reference timed on every rank at once, not on rank 0 alone: "
                   f"{fw.solo_timing_unsupported}.")
    from benchmarks import rss_peak
    if not fw.peak_memory_unsupported and rss_peak.available():
        threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset")
        out.append("note: peak mem is the process RSS high-water mark (VmHWM) during one fwd+bwd minus the "
                   f"RSS before it (MALLOC_MMAP_THRESHOLD_={threshold}), or the bytes of the storages "
                   "created if larger (a small run fits in resident pages).")
    if fw.peak_memory_unsupported:
        out.append(f"note: peak mem not measured: {fw.peak_memory_unsupported}.")
    return out


def format_notes(lines):
    """The notes wrapped to the table's width."""
    width = sum(w for _, w, _ in COLUMNS) + len(COLUMNS) - 1
    return [textwrap.fill(line, width, subsequent_indent="      ", break_on_hyphens=False) for line in lines]


def write_json(path, payload):
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def plot(path, payload):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'hyper-parallel[bench]'); no plot written")
        return
    rows = [r for r in payload["rows"] if not r.get("skipped")]
    sweep = payload.get("sweep") or []
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(16 if sweep else 11, 4.5))
    names = [r["mode"] for r in rows]
    axes[0].barh(names, [r["fwd_bwd_ms"] or 0 for r in rows], label="fwd+bwd")
    axes[0].barh(names, [r["fwd_ms"] for r in rows], label="fwd")
    axes[0].set_xlabel("ms (median)")
    axes[0].legend()
    axes[1].barh(names, [r["bytes_fwd"] / 2 ** 20 for r in rows], label="counted")
    axes[1].scatter([r["formula_bytes"] / 2 ** 20 for r in rows], names, color="k", zorder=3, label="formula")
    axes[1].set_xlabel("MiB sent per rank (forward)")
    axes[1].legend()
    if sweep:
        for mode in sorted({p["mode"] for p in sweep}):
            points = sorted((p["seq"], p["fwd_bwd_ms"]) for p in sweep if p["mode"] == mode)
            axes[2].plot([s for s, _ in points], [t for _, t in points], marker="o", label=mode)
        axes[2].set_xlabel("sequence length")
        axes[2].set_ylabel("fwd+bwd ms")
        axes[2].legend(fontsize=7)
    fig.suptitle(payload["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
