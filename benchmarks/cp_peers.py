"""Peer implementations for ``--compare`` (torch only): added when they can run here, skipped
cleanly (with the reason printed) otherwise.

* ``deepspeed-ulysses``: DeepSpeed's DistributedAttention (all-to-all around local attention).
* ``torch-dtensor-ulysses``: PyTorch DTensor redistribute Shard(seq) -> Shard(head) around SDPA.
* ``torch-ring`` (forward only): PyTorch's own ring attention,
  ``torch.distributed.tensor.experimental._attention._templated_ring_attention`` — the loop behind
  ``context_parallel()`` — with its all-to-all ring rotation (``set_rotate_method("alltoall")``; the
  default "allgather" gathers all K/V at once) and no load balancing (each rank keeps its
  contiguous block, like our ``ring`` row). ``context_parallel()`` itself only intercepts the CUDA
  SDPA kernels (flash / efficient / cuDNN), so on CPU the template is driven with the fused CPU
  kernel (``aten._scaled_dot_product_flash_attention_for_cpu``); it has no backward for that
  kernel, hence forward only. GQA is run by repeating K/V heads (the kernels need equal heads).
  Its K/V rotation goes through torch's functional collectives, which our CommDebugMode cannot
  see; the bytes it sends are recorded through the platform's comm observers as ``torch_permute``
  so that the row's "sent/rank" column is counted, not assumed.
"""
import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.cp_modes import Mode


@dataclass
class PeerMode(Mode):
    factory: object = None
    formula_as: str = "ulysses"      # the MODES row whose closed form and causal work apply
    forward_only: bool = False

    def supported(self, cfg, world, fw):
        if getattr(cfg, "window", None):
            return "the peers are timed without a sliding window"
        return super().supported(cfg, world, fw)

    def build(self, cfg, mesh, fw=None):
        return self.factory(cfg, mesh)

    def _like(self):
        return Mode(self.formula_as, 1 if self.formula_as != "ulysses" else None, False, False)

    def formula_elements(self, cfg, world):
        return self._like().formula_elements(cfg, world)

    def causal_work(self, cfg, world, rank):
        return self._like().causal_work(cfg, world, rank)


def _deepspeed_ulysses(cfg, mesh):
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    if not deepspeed.comm.is_initialized():   # its collectives go through its own comm layer
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())

    def local_attention(q, k, v, *args, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal).transpose(1, 2)
    attention = DistributedAttention(local_attention, mesh.get_group(0), scatter_idx=2, gather_idx=1)
    if "batch_dim_idx" in inspect.signature(attention.forward).parameters:  # DeepSpeed >= 0.14 asks for it
        return lambda q, k, v: attention(q, k, v, 0)
    return attention


def _torch_dtensor_ulysses(cfg, mesh):
    """PyTorch DTensor redistribute Shard(seq) -> Shard(head) around local attention."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    torch_mesh = init_device_mesh(mesh.device_type, (mesh.size(),))

    def run(q, k, v):
        heads = [DTensor.from_local(t, torch_mesh, [Shard(1)]).redistribute(torch_mesh, [Shard(2)]).to_local()
                 for t in (q, k, v)]
        q_, k_, v_ = (t.transpose(1, 2) for t in heads)
        extra = {"enable_gqa": True} if q_.shape[1] != k_.shape[1] else {}
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=cfg.causal, **extra).transpose(1, 2)
        return DTensor.from_local(out, torch_mesh, [Shard(2)]).redistribute(torch_mesh, [Shard(1)]).to_local()
    return run


# ------------------------------------------------------------------------------------ torch ring
def _torch_cp_module():
    from torch.distributed.tensor.experimental._context_parallel import _attention
    return _attention


def _torch_ring_kernel(device_type):
    aten = torch.ops.aten
    if device_type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu
    if device_type == "cuda":
        return aten._scaled_dot_product_flash_attention
    return None


def _torch_ring_unavailable(cfg, world):
    """None if torch's ring template can run here, else why not."""
    try:
        cp = _torch_cp_module()
        for name in ("_templated_ring_attention", "_cp_options", "_RotateMethod", "ft_c"):
            getattr(cp, name)
    except Exception as exc:  # moved or removed in this torch
        return f"torch {torch.__version__} has no usable ring attention template ({type(exc).__name__})"
    from hyper_parallel.platform import get_platform
    device_type = get_platform().device_type
    if _torch_ring_kernel(device_type) is None:
        return f"no torch ring kernel for device {device_type!r} (CPU and CUDA only)"
    if torch.distributed.get_backend() == "gloo" and device_type != "cpu":
        return "gloo with a non-CPU device"
    return None


class _CountingCollectives:
    """torch's functional-collectives module with ``permute_tensor`` (the ring rotation) also
    reported to our platform's comm observers."""

    def __init__(self, ft_c, ranks):
        self._ft_c, self._ranks = ft_c, ranks

    def __getattr__(self, name):
        return getattr(self._ft_c, name)

    def permute_tensor(self, tensor, dsts, group):
        from hyper_parallel.platform import get_platform
        get_platform().record_comm("torch_permute", tensor.numel() * tensor.element_size(), self._ranks)
        return self._ft_c.permute_tensor(tensor, dsts, group)


@contextlib.contextmanager
def _torch_ring_options(cp, ranks):
    """All-to-all ring rotation, no load balancing, counted rotation; restored afterwards."""
    options = cp._cp_options
    saved = (options.rotate_method, options.enable_load_balance, cp.ft_c)
    options.rotate_method, options.enable_load_balance = cp._RotateMethod.ALL_TO_ALL, False
    cp.ft_c = _CountingCollectives(saved[2], ranks)
    try:
        yield
    finally:
        options.rotate_method, options.enable_load_balance, cp.ft_c = saved


def _torch_ring(cfg, mesh):
    """PyTorch's ring attention template on BSHD blocks (forward only)."""
    cp = _torch_cp_module()
    group = mesh.get_group(0)
    ranks = tuple(mesh.group_ranks(0))
    kernel = _torch_ring_kernel(mesh.device_type)

    def run(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if k.shape[1] != q.shape[1]:
            groups = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        with torch.no_grad(), _torch_ring_options(cp, ranks):
            out, *_ = cp._templated_ring_attention(group, 2, kernel, q, k, v, is_causal=cfg.causal)
        return out.transpose(1, 2)
    return run


_PEERS = [("deepspeed-ulysses", "deepspeed", _deepspeed_ulysses, "ulysses", False),
          ("torch-dtensor-ulysses", "torch.distributed.tensor", _torch_dtensor_ulysses, "ulysses", False),
          ("torch-ring", "torch.distributed.tensor.experimental", _torch_ring, "ring", True)]


def _say(message):
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def available_peers(cfg):
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    found = []
    for name, module, factory, formula_as, forward_only in _PEERS:
        try:
            __import__(module)
        except Exception as exc:  # absent or broken install: skip, say why
            _say(f"--compare: skipping {name} ({module} not importable: {type(exc).__name__})")
            continue
        if factory is _torch_ring:
            why = _torch_ring_unavailable(cfg, world)
            if why:
                _say(f"--compare: skipping {name} ({why})")
                continue
        found.append(PeerMode(name, 1 if formula_as == "ring" else None, False, False,
                              factory=factory, formula_as=formula_as, forward_only=forward_only))
    return found
