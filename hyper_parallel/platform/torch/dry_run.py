"""The torch side of hyper_parallel.plan's dry run: one rank of an N-rank job in this process.

``FakeWorld(rank, world_size)`` initialises PyTorch's ``fake`` process-group backend (collectives
complete at once and move nothing) and holds a ``FakeTensorMode`` (tensors with shapes, dtypes and
storages of a size, but no data). ``TrainStep`` is one training step as a user writes it: input ids
of the global sequence (this rank's block under context parallelism, ``shard_sequence``), the
model's loss, ``backward()``, an AdamW step, ``zero_grad``. The same ``TrainStep`` runs on real
tensors in the tests, which is how the fake run is checked against a real one.
"""
from typing import Any, Literal
import contextlib
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel.platform.torch.dry_run_tracker import StepTracker

__all__ = ["FakeWorld", "TrainStep", "StepTracker", "meta_device", "calibrate_cpu", "dtype"]


def dtype(name: Any) -> Any:
    """torch's dtype of a name ('bfloat16', 'torch.float32'); None stays None."""
    if name is None:
        return None
    value = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dry run: dtype {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return value


def meta_device() -> Any:
    """Build a model here: parameters on ``meta`` (no memory), allocated later per rank."""
    return torch.device("meta")


class FakeWorld:
    """``with FakeWorld(rank, n) as world:`` this process is rank ``rank`` of ``n`` on the fake
    backend; ``world.fake`` is the FakeTensorMode the step runs under. Leaves no process group."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"dry run: rank {rank} is outside the job's {world_size} ranks")
        self.rank, self.world_size = rank, world_size
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)

    def __enter__(self) -> "FakeWorld":
        if dist.is_initialized():
            raise RuntimeError("dry run: a process group is already initialised in this process; run the "
                               "dry run in a process of its own (it initialises the fake backend)")
        dist.init_process_group("fake", rank=self.rank, world_size=self.world_size, store=FakeStore())
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        dist.destroy_process_group()
        return False


def _text_vocab(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)


class TrainStep:
    """One training step of ``model`` on ``batch`` sequences of ``seq_len`` tokens (this rank's
    block of them when ``cp_mesh`` is given). ``fake``: a FakeTensorMode to run under (the model is
    then allocated from meta under it), or None for a real run on allocated parameters."""

    def __init__(self, model: Any, seq_len: int, batch: int, cp_mesh: Any = None, fake: Any = None,
                 lr: float = 1e-4) -> None:
        self.model, self.seq_len, self.batch, self.cp_mesh = model, seq_len, batch, cp_mesh
        self.fake = fake
        with self._mode():
            if fake is not None or any(p.is_meta for p in model.parameters()):
                # each rank's pieces allocated (fake: shapes only); a real run's values are zeros
                model.to_empty(device="cpu")
                if fake is None:
                    with torch.no_grad():
                        for tensor in list(model.parameters()) + list(model.buffers()):
                            _local(tensor).zero_()
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
            self.vocab = _text_vocab(model)

    def _mode(self):
        return self.fake if self.fake is not None else contextlib.nullcontext()

    def _inputs(self, shard_sequence):
        ids = torch.randint(0, self.vocab, (self.batch, self.seq_len), generator=None)
        labels = torch.roll(ids, -1, dims=1)
        if self.cp_mesh is not None:
            ids, labels = shard_sequence([ids, labels], self.cp_mesh)
        # labels= makes Hugging Face compute a loss at all; shift_labels= is what it (and the chunked
        # loss) then uses: the next tokens of the whole sequence, this rank's block
        return {"input_ids": ids, "labels": labels, "shift_labels": labels,
                "num_items_in_batch": self.batch * self.seq_len}

    def run(self, shard_sequence: Any, tracker: Any = None) -> float:
        """One step; with ``tracker`` its phases are labelled. Returns the wall time (seconds)."""
        start = time.perf_counter()
        phase = tracker if tracker is not None else type("_NoTracker", (), {})()
        with self._mode(), (tracker if tracker is not None else contextlib.nullcontext()):
            phase.phase = "forward"
            loss = self.model(**self._inputs(shard_sequence)).loss
            phase.phase = "backward"
            loss.backward()
            phase.phase = "optimizer"
            self.optimizer.step()
            phase.phase = "end"
        return time.perf_counter() - start

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def parameters(self) -> list:
        return [_local(p) for p in self.model.parameters()] + [_local(b) for b in self.model.buffers()]

    def gradients(self) -> list:
        return [_local(p.grad) for p in self.model.parameters() if p.grad is not None]

    def optimizer_state(self) -> list:
        return [_local(v) for state in self.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]


def _local(tensor):
    return getattr(tensor, "_local_tensor", tensor)


def calibrate_cpu(size: int = 1024, repeats: int = 5) -> dict:
    """This machine's achieved fp32 matmul FLOP/s, memcpy bytes/s and seconds per small op (the host's
    dispatch cost of one eager op). Medians of ``repeats``, not bests: on a shared machine the median
    is what a longer run gets."""
    import statistics
    a, b = torch.randn(size, size), torch.randn(size, size)
    x = torch.empty(32 * 1024 * 1024 // 4)
    y = torch.empty_like(x)
    small = torch.ones(16)
    mm, copy, ops = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        mm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        y.copy_(x)
        copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(200):
            small = small + 1
        ops.append((time.perf_counter() - t0) / 200)
    return {"flops": 2 * size ** 3 / statistics.median(mm),
            "bytes_per_s": 2 * x.numel() * 4 / statistics.median(copy),
            "op_seconds": statistics.median(ops), "threads": torch.get_num_threads()}
