"""Peer implementations for ``--compare``: added when importable, skipped cleanly otherwise."""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.cp_modes import Mode


@dataclass
class PeerMode(Mode):
    factory: object = None

    def build(self, cfg, mesh):
        return self.factory(cfg, mesh)


def _deepspeed_ulysses(cfg, mesh):
    from deepspeed.sequence.layer import DistributedAttention

    def local_attention(q, k, v, *args, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal).transpose(1, 2)
    return DistributedAttention(local_attention, mesh.get_group(0), scatter_idx=2, gather_idx=1)


def _torch_dtensor_ulysses(cfg, mesh):
    """PyTorch DTensor redistribute Shard(seq) -> Shard(head) around local attention."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    torch_mesh = init_device_mesh(mesh.device_type, (mesh.size(),))

    def run(q, k, v):
        heads = [DTensor.from_local(t, torch_mesh, [Shard(1)]).redistribute(torch_mesh, [Shard(2)]).to_local()
                 for t in (q, k, v)]
        q_, k_, v_ = (t.transpose(1, 2) for t in heads)
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=cfg.causal).transpose(1, 2)
        return DTensor.from_local(out, torch_mesh, [Shard(2)]).redistribute(torch_mesh, [Shard(1)]).to_local()
    return run


_PEERS = [("deepspeed-ulysses", "deepspeed", _deepspeed_ulysses),
          ("torch-dtensor-ulysses", "torch.distributed.tensor", _torch_dtensor_ulysses)]


def available_peers(cfg):
    found = []
    for name, module, factory in _PEERS:
        try:
            __import__(module)
        except Exception as exc:  # absent or broken install: skip, say why
            if torch.distributed.get_rank() == 0:
                print(f"--compare: skipping {name} ({module} not importable: {type(exc).__name__})",
                      file=sys.stderr)
            continue
        found.append(PeerMode(name, None, False, False, factory=factory))
    return found
