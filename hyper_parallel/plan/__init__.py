"""hyper_parallel.plan: size a job before renting the cluster (SPEC §16, docs/planning.md).

``dry_run`` runs one training step of one rank of an N-rank job in this process on fake tensors and
PyTorch's fake process group (torch platform only); ``predict`` turns its report into step time,
tokens/s/device and MFU on a device from the roofline table; ``search`` ranks meshes, CP modes and
long-sequence features. ``python -m hyper_parallel.plan dry-run|search --help``.
"""
from hyper_parallel.plan.dry_run import DryRunReport, dry_run, real_run
from hyper_parallel.plan.options import CP_MODES, FEATURES

__all__ = ["dry_run", "real_run", "DryRunReport", "CP_MODES", "FEATURES"]
