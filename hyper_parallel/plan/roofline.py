"""Step time from a dry run's report: a roofline per op plus the communication the library leaves exposed.

Devices: peak dense bf16 FLOP/s, HBM bytes/s and capacity from the vendors' data sheets (SXM / OAM
parts); links per GPU and direction: intra-node (NVLink / HCCS) and inter-node (one InfiniBand / RoCE
NIC per GPU). ``cpu`` is calibrated on this machine (a measured fp32 matmul and memcpy).

Assumptions (printed with every prediction):
- an op takes max(FLOPs / (peak x 0.75), bytes / (HBM x 0.85)) (GEMM and copy efficiencies of
  well-tuned kernels); ops without a FLOP formula are memory-bound;
- a collective takes bytes / link + latency, on the slowest link of its group (inter-node when the
  group spans nodes; ranks are laid out row-major over the mesh, ``gpus_per_node`` per node);
- fully_shard's all-gathers and reduce-scatters overlap the step's compute (its prefetch), all but
  one unit's worth; the ring's P2P hops overlap at most half the compute (the attention's share at
  long sequence), all but one hop; Ulysses / all-gather K/V, expert all-to-alls and tensor-parallel
  collectives are exposed (the library issues them on the critical path);
- a peak fits when it is at most USABLE_FRACTION of the device's memory;
- MFU counts the model's FLOPs: with activation checkpointing a quarter of the executed FLOPs is
  recompute (one extra forward).
"""
import math
from typing import Dict, Optional

from hyper_parallel.plan.report import DryRunReport

_MIB = 2 ** 20
# "Does not fit": the dry run's peak (bytes of live tensors) above USABLE_FRACTION of the device's
# memory (the total nvidia-smi / npu-smi reports). The rest goes to the CUDA context and kernels' and
# cuBLAS workspaces (~1 GiB), NCCL's buffers (~1-2 GiB at the meshes searched) and the caching
# allocator's fragmentation (a few % of the peak); docs/planning.md states what was measured.
USABLE_FRACTION = 0.92
DEVICES: Dict[str, dict] = {
    # flops: dense bf16; hbm: bytes/s; memory: bytes (the total the driver reports); intra / inter:
    # bytes/s per GPU per direction
    "h100": dict(flops=989e12, hbm=3.35e12, memory=81559 * _MIB, intra=450e9, inter=50e9, intra_lat=3e-6,
                 inter_lat=10e-6, links="NVLink 4 (450 GB/s) / InfiniBand NDR 400 Gb/s per GPU"),
    "h200": dict(flops=989e12, hbm=4.8e12, memory=143771 * _MIB, intra=450e9, inter=50e9, intra_lat=3e-6,
                 inter_lat=10e-6, links="NVLink 4 (450 GB/s) / InfiniBand NDR 400 Gb/s per GPU"),
    "a100": dict(flops=312e12, hbm=2.039e12, memory=81920 * _MIB, intra=300e9, inter=25e9, intra_lat=4e-6,
                 inter_lat=10e-6, links="NVLink 3 (300 GB/s) / InfiniBand HDR 200 Gb/s per GPU"),
    "b200": dict(flops=2250e12, hbm=8e12, memory=183359 * _MIB, intra=900e9, inter=50e9, intra_lat=3e-6,
                 inter_lat=10e-6, links="NVLink 5 (900 GB/s) / InfiniBand 400 Gb/s per GPU"),
    "ascend910b": dict(flops=320e12, hbm=1.6e12, memory=65536 * _MIB, intra=196e9, inter=25e9, intra_lat=5e-6,
                       inter_lat=15e-6, links="HCCS (196 GB/s) / RoCE 200 Gb/s per NPU"),
}
GEMM_EFFICIENCY, HBM_EFFICIENCY = 0.75, 0.85
_FSDP_DIMS = ("dp_shard", "dp_replicate")


def device(name: str, calibration: Optional[dict] = None) -> dict:
    """The table's entry, or ``cpu`` from ``calibration`` (platform/torch/dry_run.calibrate_cpu)."""
    if name == "cpu":
        if calibration is None:
            from hyper_parallel.plan.dry_run import torch_tools
            calibration = torch_tools().calibrate_cpu()
        copy = calibration["bytes_per_s"]
        # gloo on one host moves bytes through shared memory and sockets: a quarter of memcpy, 50 us
        return dict(flops=calibration["flops"] / GEMM_EFFICIENCY, hbm=copy / HBM_EFFICIENCY, memory=None,
                    op_seconds=calibration.get("op_seconds", 0.0),
                    intra=copy / 4, inter=copy / 4, intra_lat=50e-6, inter_lat=50e-6,
                    links=f"gloo on this host (a quarter of memcpy, {copy / 4e9:.1f} GB/s)")
    if name not in DEVICES:
        raise ValueError(f"device {name!r} is unknown; pass one of {sorted(DEVICES) + ['cpu']}")
    return DEVICES[name]


def _group_spans_nodes(mesh: Dict[str, int], dims, gpus_per_node: int) -> bool:
    names = list(mesh)
    strides = {n: math.prod(list(mesh.values())[i + 1:]) for i, n in enumerate(names)}
    top = sum(strides[d] * (mesh[d] - 1) for d in dims if d in mesh)
    return top >= gpus_per_node


def comm_seconds(report: DryRunReport, dev: dict, gpus_per_node: int) -> Dict[str, float]:
    """Seconds per mesh dim label of the report's collectives."""
    out = {}
    for label, entry in report.comm.items():
        dims = list(report.mesh) if label in ("world", "other") else label.split("+")
        inter = _group_spans_nodes(report.mesh, dims, gpus_per_node)
        bandwidth, latency = (dev["inter"], dev["inter_lat"]) if inter else (dev["intra"], dev["intra_lat"])
        out[label] = entry["bytes_sent"] / bandwidth + entry["collectives"] * latency
    return out


def compute_seconds(report: DryRunReport, dev: dict) -> float:
    flops, hbm = dev["flops"] * GEMM_EFFICIENCY, dev["hbm"] * HBM_EFFICIENCY
    ops = sum(n * max(f / flops, b / hbm) for (f, b), n in report.ops.items())
    # eager dispatch on the host: measured per op on cpu; a GPU's launches run ahead of its kernels
    return ops + report.memory_bound_bytes / hbm + report.op_count * dev.get("op_seconds", 0.0)


def _exposed(report: DryRunReport, seconds: Dict[str, float], compute: float) -> float:
    """Communication left on the critical path, per mesh dim label, split by op: fully_shard's
    all-gathers / reduce-scatters hide behind compute but one unit's; P2P ring hops behind half the
    compute but one hop; expert all-to-alls, Ulysses, all-gather K/V, TP and checks are exposed."""
    units = max(1, (report.layers[1] if report.layers else 1) + 1)
    exposed = 0.0
    for label, t in seconds.items():
        dims, entry = label.split("+"), report.comm[label]
        total = max(1, entry["bytes_sent"])
        for op, (count, nbytes) in entry["ops"].items():
            share = t * (nbytes / total if entry["bytes_sent"] else count / max(1, entry["collectives"]))
            if op == "send_recv" and "cp" in dims:
                hops = max(1, report.mesh.get("cp", 1) - 1)
                exposed += max(share / hops, share - 0.5 * compute)
            elif any(d in _FSDP_DIMS for d in dims) and op in ("all_gather", "reduce_scatter", "all_reduce"):
                exposed += max(share / units, share - compute)
            else:
                exposed += share
    return exposed


def predict(report: DryRunReport, device_name: str, gpus_per_node: int = 8,
            calibration: Optional[dict] = None, memory_bytes: Optional[float] = None) -> dict:
    """Step seconds, tokens/s/device, MFU and whether the peak fits, with the assumptions."""
    dev = device(device_name, calibration)
    compute = compute_seconds(report, dev)
    seconds = comm_seconds(report, dev, gpus_per_node)
    exposed = _exposed(report, seconds, compute)
    step = compute + exposed
    tokens = report.tokens_per_rank / max(1, report.mesh.get("tp", 1))
    model_flops = report.flops * (0.75 if "checkpoint" in report.features else 1.0)
    capacity = memory_bytes if memory_bytes is not None else dev["memory"]
    return {"device": device_name, "step_seconds": step, "compute_seconds": compute,
            "exposed_comm_seconds": exposed, "comm_seconds": seconds,
            "tokens_per_second_per_device": tokens / step if step > 0 else 0.0,
            "mfu": model_flops / (step * dev["flops"]) if step > 0 else 0.0,
            "fits": fits(report.peak_memory_bytes, capacity),
            "assumptions": assumptions(dev, gpus_per_node, capacity)}


def fits(peak_bytes: float, capacity: Optional[float]) -> bool:
    """Whether a peak fits: at most ``USABLE_FRACTION`` of ``capacity`` (None: no limit)."""
    return capacity is None or peak_bytes <= USABLE_FRACTION * capacity


def assumptions(dev: dict, gpus_per_node: int, capacity: Optional[float]) -> list:
    cap = ("no limit" if capacity is None else
           f"{capacity / 2 ** 30:.1f} GiB, {USABLE_FRACTION:.0%} usable by tensors")
    return [f"{dev['flops'] / 1e12:.0f} TFLOP/s dense bf16 x {GEMM_EFFICIENCY}, "
            f"HBM {dev['hbm'] / 1e12:.2f} TB/s "
            f"x {HBM_EFFICIENCY}, memory {cap}",
            f"links {dev['links']}; {gpus_per_node} GPUs per node, ranks row-major over the mesh",
            "fully_shard collectives hidden behind compute but one unit's; ring hops behind half the compute "
            "but one hop; Ulysses, all-gather K/V, expert all-to-all and TP collectives exposed",
            "MFU from the model's FLOPs (activation checkpointing: a quarter of them is recompute, not "
            "counted)"]
