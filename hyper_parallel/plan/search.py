"""``search``: meshes x CP modes x long-sequence features, pruned by dry runs, ranked by predicted time.

Candidates: every dp_shard x cp x tp with product ``gpus`` (tp within a node and dividing the heads,
the sequence divisible by 2 cp), HSDP (dp_replicate = nodes) without cp. CP modes: ulysses,
allgather_lb, zigzag (``all_modes``: also allgather and ring, which leave the causal work unbalanced).
Features are tried cheapest first and the first that fits is kept: the chunked loss always, then
activation checkpointing, then tiled MLP (each saves memory and costs recompute).

For a MoE model every mesh is also tried with ep over its data dims (``expert_options``). Each
candidate is dry-run for its rank roles (``roles``: the last rank, and rank 0 where a split is uneven
or the CP mode unbalanced; the peak is the largest, the step the slowest) on the model cut to k and 2k
layers (scaling.py); a rung whose k-layer run already exceeds the usable memory is skipped. Dry runs
are cached per (mesh, mode, features, layers, rank, ep). Candidates are ranked by predicted time per
token (tokens/s per device): a step of more data-parallel ranks trains more tokens.
"""
import math
import sys
from typing import Any, List, Optional, Tuple

from hyper_parallel.plan.models import layer_period, load_config, model_fn
from hyper_parallel.plan.roofline import DEVICES, fits, predict
from hyper_parallel.plan.scaling import scaled_dry_run

FEATURE_LADDER = (("chunked_loss",), ("chunked_loss", "checkpoint"),
                  ("chunked_loss", "checkpoint", "tiled_mlp"))
DEFAULT_MODES = ("ulysses", "allgather_lb", "zigzag")
ALL_MODES = ("ulysses", "allgather", "allgather_lb", "ring", "zigzag")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_options(mesh: dict, experts: int) -> List[Optional[Tuple[str, ...]]]:
    """ep choices of a mesh for a model with ``experts`` routed experts (0: dense): none (experts under
    fully_shard), the dp_shard ranks, the dp_shard x cp ranks — each where its size divides the experts
    (SPEC §17: experts split over data ranks; HSDP's dp_replicate is not wired for ep)."""
    out: List[Optional[Tuple[str, ...]]] = [None]
    if not experts or mesh.get("dp_replicate", 1) > 1:
        return out
    for dims in (("dp_shard",), ("dp_shard", "cp")):
        size = math.prod(mesh.get(d, 1) for d in dims)
        if size > 1 and experts % size == 0 and all(mesh.get(d, 1) > 1 for d in dims[1:]):
            out.append(dims)
    return out


def roles(mesh: dict, mode: Optional[str], uneven: bool) -> Tuple[int, ...]:
    """The ranks whose dry runs bound the job: the last rank (the last CP block: the most causal work
    in the unbalanced modes), and rank 0 (coordinate 0 on every dim: the larger piece of every uneven
    split) where something is uneven or the mode unbalanced. There is no pipeline here, and the
    embedding / lm_head are split like every other parameter (fully_shard pads its shards evenly), so
    every other rank repeats one of these two."""
    last = math.prod(mesh.values()) - 1
    return (last, 0) if last and (uneven or mode in ("allgather", "ring")) else (last,)


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

    def __init__(self, total: int, stream: Optional[Any] = None) -> None:
        # sys.stderr looked up now, not at import (a caller may have redirected it since)
        self.total, self.done, self.stream = max(1, total), 0, stream or sys.stderr

    def step(self, label: str) -> None:
        self.done += 1
        filled = int(30 * self.done / self.total)
        bar = "#" * filled + "." * (30 - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label[:60]:60s}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")


_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_SPLIT = ("vocab_size", "intermediate_size", "hidden_size", "num_attention_heads", "num_key_value_heads")


class Searcher:
    def __init__(self, model: str, seq: int, gpus: int, device: str, gpus_per_node: int = 8, batch: int = 1,
                 memory_gib: Optional[float] = None, dtype: str = "bfloat16",
                 layers: Optional[int] = None, master_dtype: Optional[str] = None,
                 reduce_dtype: Optional[str] = None) -> None:
        from hyper_parallel.plan.dry_run import dry_run
        self._dry_run = dry_run
        self.model, self.seq, self.gpus, self.device = model, seq, gpus, device
        self.gpus_per_node, self.batch, self.dtype = gpus_per_node, batch, dtype
        self.master_dtype, self.reduce_dtype = master_dtype, reduce_dtype
        self.memory = memory_gib * 2 ** 30 if memory_gib is not None else None
        config, _ = load_config(model, dtype)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.heads, self.total_layers = int(text.num_attention_heads), int(text.num_hidden_layers)
        self.experts = next((int(getattr(text, n)) for n in _EXPERTS if getattr(text, n, None)), 0)
        self.sizes = [int(getattr(text, n)) for n in _SPLIT if isinstance(getattr(text, n, None), int)]
        self.period = layers or layer_period(model)
        self._cache = {}
        self.refused = []

    def _run(self, mesh: dict, mode, features, layers: int, rank: int, ep):
        key = (tuple(mesh.items()), mode, features, layers, rank, ep)
        if key not in self._cache:
            build, _ = model_fn(self.model, layers=layers, dtype=self.master_dtype or self.dtype)
            extra = {"ep": ep} if ep else {}
            if self.master_dtype:
                extra.update(param_dtype=self.dtype, reduce_dtype=self.reduce_dtype)
            self._cache[key] = self._dry_run(build, tuple(mesh.values()), tuple(mesh), rank=rank,
                                             seq_len=self.seq, batch=self.batch, cp_mode=mode,
                                             features=features, model_name=self.model, **extra)
        return self._cache[key]

    def _roles(self, mesh: dict, mode) -> Tuple[int, ...]:
        tp = mesh.get("tp", 1)
        return roles(mesh, mode, any(n % tp for n in self.sizes))

    def evaluate(self, mesh: dict, mode, ep=None) -> Optional[dict]:
        """The first rung of the feature ladder that fits (or the last one tried), predicted: the
        peak is the largest of the rank roles' (``roles``), the step time the slowest role's."""
        result = None
        for features in FEATURE_LADDER:
            try:
                if features != FEATURE_LADDER[-1] and self._exceeds_at_k(mesh, mode, features, ep):
                    continue
            except (ValueError, NotImplementedError) as error:
                self.refused.append((_label(mesh, ep), mode, features, str(error).splitlines()[0][:200]))
                return result
            predictions = []
            for rank in self._roles(mesh, mode):
                try:
                    report = scaled_dry_run(lambda n: self._run(mesh, mode, features, n, rank, ep),
                                            self.period, self.total_layers)
                except (ValueError, NotImplementedError) as error:
                    self.refused.append((_label(mesh, ep), mode, features, str(error).splitlines()[0][:200]))
                    return result
                predictions.append((report, predict(report, self.device, self.gpus_per_node,
                                                    memory_bytes=self.memory)))
            peak = max(r.peak_memory_bytes for r, _ in predictions)
            p = max((p for _, p in predictions), key=lambda q: q["step_seconds"])
            fits = all(q["fits"] for _, q in predictions)
            result = {"mesh": _label(mesh, ep), "cp_mode": mode, "features": list(features),
                      "peak_memory_bytes": peak, "fits": fits, "step_seconds": p["step_seconds"],
                      "tokens_per_second_per_device": p["tokens_per_second_per_device"], "mfu": p["mfu"],
                      "_prediction": p, "_ep": ep}
            if fits:
                return result
        return result

    def _exceeds_at_k(self, mesh: dict, mode, features, ep) -> bool:
        """Pruning by the first dry run: the model cut to k layers already peaks above the usable
        memory, so the whole model (more layers, never less memory) does not fit either; the 2k-layer
        run is skipped and the next rung of the ladder tried."""
        capacity = self.memory if self.memory is not None else DEVICES.get(self.device, {}).get("memory")
        if capacity is None or self.total_layers <= 2 * self.period:
            return False
        return any(not fits(self._run(mesh, mode, features, self.period, rank, ep).peak_memory_bytes,
                            capacity) for rank in self._roles(mesh, mode))

    def plans(self, all_modes: bool = False, only: Optional[dict] = None) -> list:
        """(mesh, cp mode, ep dims) to evaluate; ``only``: {"tp": [...], "cp": [...], "modes": [...]}."""
        only = only or {}
        modes = only.get("modes") or (ALL_MODES if all_modes else DEFAULT_MODES)
        return [(m, mode, ep) for m in meshes(self.gpus, self.heads, self.seq, self.gpus_per_node)
                if all(not only.get(d) or m[d] in only[d] for d in ("tp", "cp"))
                for ep in expert_options(m, self.experts)
                for mode in (modes if m["cp"] > 1 else (None,))]

    def run(self, all_modes: bool = False, progress: bool = True, only: Optional[dict] = None) -> dict:
        plans = self.plans(all_modes, only)
        bar = Progress(len(plans)) if progress else None
        found = []
        for mesh, mode, ep in plans:
            result = self.evaluate(mesh, mode, ep)
            if result is not None:
                found.append(result)
            if bar:
                bar.step(f"{_label(mesh, ep)} {mode or ''}")
        if bar:
            bar.close()
        # by time per token: candidates with more data-parallel ranks train more tokens per step
        found.sort(key=lambda c: (not c["fits"], -c["tokens_per_second_per_device"]))
        best = found[0] if found and found[0]["fits"] else None
        return {"model": self.model, "seq": self.seq, "gpus": self.gpus, "device": self.device, "best": best,
                "candidates": found}


def _label(mesh: dict, ep) -> dict:
    """The candidate's mesh as reported: the mesh dims, plus ``ep``: the expert-parallel degree."""
    return dict(mesh, ep=math.prod(mesh.get(d, 1) for d in ep)) if ep else dict(mesh)


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
    ep = c.get("_ep")
    return mesh + (f"({'+'.join(ep)})" if ep else "") + (f" {c['cp_mode']}" if c["cp_mode"] else "")


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
