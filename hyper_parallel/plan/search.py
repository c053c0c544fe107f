"""``search``: meshes x CP modes x long-sequence features, pruned by dry runs, ranked by predicted time.

Candidates: every dp_shard x cp x tp with product ``gpus`` (tp within a node and dividing the heads,
the sequence divisible by 2 cp), HSDP (dp_replicate = nodes) without cp. CP modes: ulysses,
allgather_lb, zigzag (``all_modes``: also allgather and ring, which leave the causal work unbalanced).
Features are tried cheapest first and the first that fits is kept: the chunked loss always, then
activation checkpointing, then tiled MLP (each saves memory and costs recompute).

Each candidate is one dry run of the busiest rank (the job's last rank: the last CP rank does the most
causal work in the unbalanced modes; all ranks hold the same memory up to uneven shards) on the model
cut to k and 2k layers (scaling.py); dry runs are cached per (mesh, mode, features, layers, rank).
Candidates are ranked by predicted time per token (tokens/s per device): a step of more data-parallel
ranks trains more tokens.
"""
import math
import sys
from typing import List, Optional

from hyper_parallel.plan.models import layer_period, load_config, model_fn
from hyper_parallel.plan.roofline import predict
from hyper_parallel.plan.scaling import scaled_dry_run

FEATURE_LADDER = (("chunked_loss",), ("chunked_loss", "checkpoint"),
                  ("chunked_loss", "checkpoint", "tiled_mlp"))
DEFAULT_MODES = ("ulysses", "allgather_lb", "zigzag")
ALL_MODES = ("ulysses", "allgather", "allgather_lb", "ring", "zigzag")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(gpus: int, heads: int, seq: int, gpus_per_node: int) -> List[dict]:
    out = []
    for tp in _divisors(gpus):
        if tp > gpus_per_node or heads % tp:
            continue
        for cp in _divisors(gpus // tp):
            if seq % (2 * cp):
                continue
            dp = gpus // (tp * cp)
            out.append({"dp_shard": dp, "cp": cp, "tp": tp})
            nodes = gpus // gpus_per_node
            if cp == 1 and nodes > 1 and dp % nodes == 0 and dp > nodes:
                out.append({"dp_replicate": nodes, "dp_shard": dp // nodes, "cp": 1, "tp": tp})
    return out


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total, self.done, self.stream = max(1, total), 0, stream

    def step(self, label: str) -> None:
        self.done += 1
        filled = int(30 * self.done / self.total)
        bar = "#" * filled + "." * (30 - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label[:60]:60s}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")


class Searcher:
    def __init__(self, model: str, seq: int, gpus: int, device: str, gpus_per_node: int = 8, batch: int = 1,
                 memory_gib: Optional[float] = None, dtype: str = "bfloat16",
                 layers: Optional[int] = None) -> None:
        from hyper_parallel.plan.dry_run import dry_run
        self._dry_run = dry_run
        self.model, self.seq, self.gpus, self.device = model, seq, gpus, device
        self.gpus_per_node, self.batch, self.dtype = gpus_per_node, batch, dtype
        self.memory = memory_gib * 2 ** 30 if memory_gib is not None else None
        config, _ = load_config(model, dtype)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.heads, self.total_layers = int(text.num_attention_heads), int(text.num_hidden_layers)
        self.period = layers or layer_period(model)
        self._cache = {}
        self.refused = []

    def _run(self, mesh: dict, mode, features, layers: int):
        rank = math.prod(mesh.values()) - 1
        key = (tuple(mesh.items()), mode, features, layers, rank)
        if key not in self._cache:
            build, _ = model_fn(self.model, layers=layers, dtype=self.dtype)
            self._cache[key] = self._dry_run(build, tuple(mesh.values()), tuple(mesh), rank=rank,
                                             seq_len=self.seq, batch=self.batch, cp_mode=mode,
                                             features=features, model_name=self.model)
        return self._cache[key]

    def evaluate(self, mesh: dict, mode) -> Optional[dict]:
        """The first rung of the feature ladder that fits (or the last one tried), predicted."""
        result = None
        for features in FEATURE_LADDER:
            try:
                report = scaled_dry_run(lambda n: self._run(mesh, mode, features, n), self.period,
                                        self.total_layers)
            except (ValueError, NotImplementedError) as error:
                self.refused.append((mesh, mode, features, str(error).splitlines()[0][:200]))
                return result
            p = predict(report, self.device, self.gpus_per_node, memory_bytes=self.memory)
            result = {"mesh": dict(mesh), "cp_mode": mode, "features": list(features),
                      "peak_memory_bytes": report.peak_memory_bytes, "fits": p["fits"],
                      "step_seconds": p["step_seconds"], "tokens_per_second_per_device":
                      p["tokens_per_second_per_device"], "mfu": p["mfu"], "_prediction": p}
            if p["fits"]:
                return result
        return result

    def run(self, all_modes: bool = False, progress: bool = True, only: Optional[dict] = None) -> dict:
        """``only``: {"tp": [...], "cp": [...], "modes": [...]} restricts the enumeration."""
        only = only or {}
        modes = only.get("modes") or (ALL_MODES if all_modes else DEFAULT_MODES)
        plans = [(m, mode) for m in meshes(self.gpus, self.heads, self.seq, self.gpus_per_node)
                 if all(not only.get(d) or m[d] in only[d] for d in ("tp", "cp"))
                 for mode in (modes if m["cp"] > 1 else (None,))]
        bar = Progress(len(plans)) if progress else None
        found = []
        for mesh, mode in plans:
            result = self.evaluate(mesh, mode)
            if result is not None:
                found.append(result)
            if bar:
                bar.step(f"{mesh} {mode or ''}")
        if bar:
            bar.close()
        # by time per token: candidates with more data-parallel ranks train more tokens per step
        found.sort(key=lambda c: (not c["fits"], -c["tokens_per_second_per_device"]))
        best = found[0] if found and found[0]["fits"] else None
        return {"model": self.model, "seq": self.seq, "gpus": self.gpus, "device": self.device, "best": best,
                "candidates": found}


def public(result: dict) -> dict:
    """The SPEC §16 JSON object (no private keys)."""
    def clean(c):
        return None if c is None else {k: v for k, v in c.items() if not k.startswith("_")}
    return dict(result, best=clean(result["best"]), candidates=[clean(c) for c in result["candidates"]])


def why(result: dict) -> str:
    fits = [c for c in result["candidates"] if c["fits"]]
    if not fits:
        return "nothing fits: every candidate's peak exceeds the device memory (see the table)"
    best = fits[0]
    text = (f"the most tokens/s per device of the candidates that fit: "
            f"{best['tokens_per_second_per_device']:.0f} ({best['step_seconds']:.3f} s per step), peak "
            f"{best['peak_memory_bytes'] / 2 ** 30:.1f} GiB")
    if len(fits) > 1:
        slower = best["tokens_per_second_per_device"] / fits[1]["tokens_per_second_per_device"] - 1
        text += f"; the next, {_mesh_text(fits[1])}, is {slower:.0%} slower per token"
    return text


def _mesh_text(c: dict) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in c["mesh"].items() if v > 1) or "1 rank"
    return mesh + (f" {c['cp_mode']}" if c["cp_mode"] else "")


def table(result: dict) -> str:
    lines = [f"{result['model']}, seq {result['seq']}, {result['gpus']} x {result['device']}",
             f"   {'mesh':34s} {'features':34s} {'peak GiB':>9s} {'fits':>5s} {'step s':>9s} "
             f"{'tok/s/dev':>10s} {'MFU':>6s}"]
    for c in result["candidates"]:
        mark = "*" if c is result["best"] else " "
        lines.append(f" {mark} {_mesh_text(c):34s} {','.join(c['features']):34s} "
                     f"{c['peak_memory_bytes'] / 2 ** 30:9.1f} {'yes' if c['fits'] else 'no':>5s} "
                     f"{c['step_seconds']:9.3f} {c['tokens_per_second_per_device']:10.0f} "
                     f"{100 * c['mfu']:5.1f}%")
    lines.append(f"* best: {why(result)}")
    if result["candidates"] and result["candidates"][0].get("_prediction"):
        lines.extend(f"  assumption: {a}" for a in result["candidates"][0]["_prediction"]["assumptions"])
    return "\n".join(lines)
