"""MindSpore platform (skeleton: process groups and real collectives; DTensor parity is issue 8).

On CPU MindSpore provides AllReduce, AllGather, Broadcast and Barrier only; the other
collectives are emulated from those and the capability table says so.
"""
import mindspore as ms
from mindspore import mint, ops
from mindspore.communication import create_group, get_group_size, get_rank, init

from hyper_parallel.platform.base import CompletedHandle, Platform

_OPS = {"sum": ops.ReduceOp.SUM, "max": ops.ReduceOp.MAX, "min": ops.ReduceOp.MIN}
_WORLD = "hccl_world_group"


class MindSporePlatform(Platform):
    name = "mindspore"
    Tensor = ms.Tensor
    Module = ms.nn.Cell
    Parameter = ms.Parameter

    def __init__(self):
        super().__init__()
        self._groups = {}
        self._initialized = False

    @property
    def device_type(self):
        return ms.get_context("device_target").lower()

    @property
    def default_backend(self):
        return {"ascend": "hccl", "gpu": "nccl"}.get(self.device_type, "mccl")

    def capabilities(self):
        native = self.device_type != "cpu"
        emulated = "emulated: all_gather + local slicing"
        return {"backend": self.default_backend, "all_gather": "native", "all_reduce": "native",
                "broadcast": "native",
                "all_to_all_single": "native" if native else emulated,
                "reduce_scatter": "native" if native else "emulated: all_reduce + local slice",
                "p2p": "native" if native else emulated}

    # ---------------------------------------------------------------- groups
    def init_process_group(self, backend=None, **kwargs):
        if not self._initialized:
            init()
            self._initialized = True

    def is_initialized(self):
        return self._initialized

    def get_rank(self, group=None):
        return get_rank() if group is None else self.group_ranks(group).index(get_rank())

    def get_world_size(self, group=None):
        return get_group_size() if group is None else len(self.group_ranks(group))

    def new_group(self, ranks):
        ranks = tuple(int(r) for r in ranks)
        if ranks not in self._groups:
            name = _WORLD if ranks == tuple(range(get_group_size())) else \
                "hp_" + "_".join(map(str, ranks))
            if name != _WORLD and get_rank() in ranks:
                create_group(name, list(ranks))
            self._groups[ranks] = name
        return self._groups[ranks]

    def group_ranks(self, group):
        if group is None or group == _WORLD:
            return tuple(range(get_group_size()))
        for ranks, name in self._groups.items():
            if name == group:
                return ranks
        raise KeyError(f"unknown group {group!r}")

    def barrier(self, group=None):
        mint.distributed.barrier(group or _WORLD)

    def destroy_process_group(self):
        self.barrier()

    # ---------------------------------------------------------------- collectives
    def all_gather(self, tensor, group, dim=0, async_op=False):
        n = len(self.group_ranks(group))
        self.record_comm("all_gather", (n - 1) * tensor.nbytes, self.group_ranks(group))
        out = ops.AllGather(group=group or _WORLD)(tensor.swapaxes(0, dim).contiguous())
        out = out.swapaxes(0, dim)
        return CompletedHandle(out) if async_op else out

    def all_reduce(self, tensor, group, op="sum", async_op=False):
        n = len(self.group_ranks(group))
        self.record_comm("all_reduce", 2 * tensor.nbytes * (n - 1) // n, self.group_ranks(group))
        out = ops.AllReduce(_OPS["sum" if op == "avg" else op], group=group or _WORLD)(tensor)
        out = out / n if op == "avg" else out
        return CompletedHandle(out) if async_op else out

    def broadcast(self, tensor, src, group, async_op=False):
        out = ops.Broadcast(src, group=group or _WORLD)((tensor,))[0]
        return CompletedHandle(out) if async_op else out

    def all_to_all_single(self, tensor, group, split_dim=0, concat_dim=0, async_op=False):
        ranks = self.group_ranks(group)
        me = ranks.index(get_rank())
        gathered = self.all_gather(tensor.unsqueeze(0), group, 0)
        pieces = [g.chunk(len(ranks), split_dim)[me] for g in gathered]
        out = ops.cat(pieces, concat_dim)
        return CompletedHandle(out) if async_op else out

    def reduce_scatter(self, tensor, group, dim=0, op="sum", async_op=False):
        ranks = self.group_ranks(group)
        out = self.all_reduce(tensor, group, op).chunk(len(ranks), dim)[ranks.index(get_rank())]
        return CompletedHandle(out) if async_op else out

    # ---------------------------------------------------------------- modules
    def register_forward_pre_hook(self, module, hook, with_kwargs=False):
        return module.register_forward_pre_hook(hook)

    def register_forward_hook(self, module, hook, with_kwargs=False):
        return module.register_forward_hook(hook)

    @staticmethod
    def is_linear(module):
        return isinstance(module, (ms.nn.Dense, getattr(mint.nn, "Linear", ms.nn.Dense)))

    @staticmethod
    def is_embedding(module):
        return isinstance(module, ms.nn.Embedding)
