"""DryRunReport: what one rank's training step allocates, computes and moves (SPEC §16)."""
import dataclasses
import math
from typing import Dict, List, Optional, Tuple

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers",
              "temporaries")


@dataclasses.dataclass
class DryRunReport:
    """One rank role's step. ``comm`` maps a mesh dim (or ``a+b`` for a flattened pair, ``world``)
    to ``{"collectives", "bytes_sent", "bytes_received", "ops": {op: [count, bytes]}}``; ``ops`` counts
    the ops with a FLOP formula by (FLOPs, bytes read+written), for the roofline."""
    model: str
    mesh: Dict[str, int]
    rank: int
    seq: int
    batch: int
    cp_mode: Optional[str]
    features: List[str]
    memory_bytes: Dict[str, int]
    peak_memory_bytes: int
    flops: int
    comm: Dict[str, dict]
    wall_seconds: float = 0.0
    layers: Optional[Tuple[int, int]] = None       # (layers run, layers of the model) when scaled
    memory_bound_bytes: int = 0
    ops: Dict[Tuple[int, int], float] = dataclasses.field(default_factory=dict, repr=False)
    prediction: Optional[dict] = None
    step_wall_seconds: float = 0.0     # the measured step's wall time here (meaningful for a real run)
    op_count: int = 0                  # computing ops dispatched (the host's per-op cost, roofline.py)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def tokens_per_rank(self) -> int:
        """Tokens this rank's step trains on (its block of each sequence)."""
        return self.batch * self.seq // max(1, self.mesh.get("cp", 1))

    def to_json(self) -> dict:
        out = {"model": self.model, "mesh": dict(self.mesh), "rank": self.rank, "seq": self.seq,
               "batch": self.batch, "cp_mode": self.cp_mode, "features": list(self.features),
               "memory_bytes": dict(self.memory_bytes), "peak_memory_bytes": self.peak_memory_bytes,
               "flops": self.flops,
               "comm": {dim: {"collectives": c["collectives"], "bytes_sent": c["bytes_sent"],
                              "bytes_received": c["bytes_received"],
                              # per collective kind (all_to_all: expert dispatch / Ulysses): count, bytes
                              "ops": {op: {"count": n, "bytes_sent": b} for op, (n, b) in c["ops"].items()}}
                        for dim, c in self.comm.items()},
               "wall_seconds": round(self.wall_seconds, 3)}
        if self.layers is not None:
            out["layers_run"], out["layers"] = self.layers
        if self.prediction is not None:
            out["prediction"] = self.prediction
        return out

    def format(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [f"dry run: {self.model}, seq {self.seq}, batch {self.batch}, mesh {mesh}, rank {self.rank}"
                 f"{', cp ' + self.cp_mode if self.cp_mode else ''}"
                 f"{', ' + ','.join(self.features) if self.features else ''}"]
        if self.layers is not None:
            lines.append(f"  (ran {self.layers[0]} and {2 * self.layers[0]} layers; per-layer costs scaled "
                         f"to {self.layers[1]})")
        lines.append(f"  peak memory {gib(self.peak_memory_bytes)}")
        for name in CATEGORIES:
            lines.append(f"    {name:22s} {gib(self.memory_bytes.get(name, 0))}")
        lines.append(f"  FLOPs {self.flops:.4g}")
        lines.append("  communication per mesh dim (this rank):")
        for dim, c in sorted(self.comm.items()):
            ops = ", ".join(f"{op} x{n} {b:,d} B" for op, (n, b) in sorted(c["ops"].items()))
            lines.append(f"    {dim:14s} {c['collectives']:5d} collectives  sent {c['bytes_sent']:>16,d} B  "
                         f"received {c['bytes_received']:>16,d} B  ({ops})")
        if self.prediction:
            lines.extend("  " + line for line in format_prediction(self.prediction))
        lines.append(f"  dry run took {self.wall_seconds:.1f} s")
        return "\n".join(lines)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:10.3f} GiB"


def format_prediction(p: dict) -> List[str]:
    lines = [f"predicted on {p['device']}: step {p['step_seconds']:.3f} s, "
             f"{p['tokens_per_second_per_device']:.0f} tokens/s/device, MFU {100 * p['mfu']:.1f} % "
             f"(compute {p['compute_seconds']:.3f} s, exposed communication "
             f"{p['exposed_comm_seconds']:.3f} s)"]
    lines.extend(f"  assumption: {a}" for a in p["assumptions"])
    return lines
