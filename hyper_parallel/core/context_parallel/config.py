"""ContextParallel's settings, grouped: where q/k/v are (layout), how K/V travel (exchange), the
head-group pipelining (overlap) and ``mode="auto"``'s options (auto).

``ContextParallel(...)`` keeps its flat keywords (SPEC) and builds one ``ContextParallelConfig``
from them; each group checks its own fields when it is built, the config the checks that span two
groups, so a bad value raises the same ValueError however the style is constructed.
"""
from dataclasses import dataclass
from typing import Literal, Optional, Tuple, Union
import os

from hyper_parallel.core.arguments import check_int, check_optional_float, check_optional_int

KV_EXCHANGES = ("allgather", "ring")
_WHO = "ContextParallel"


@dataclass(frozen=True)
class CPLayout:
    """Where the module takes q, k, v and which of their dims hold the sequence and the heads."""
    seq_dim: int = 1
    head_dim: int = 2
    qkv_indices: Tuple[int, ...] = (0, 1, 2)
    qkv_kwarg_names: Tuple[str, ...] = ()
    use_local_output: bool = False

    def __post_init__(self) -> None:
        # sequences given as lists: stored as tuples, so the config hashes and compares by value
        object.__setattr__(self, "qkv_indices", tuple(self.qkv_indices))
        object.__setattr__(self, "qkv_kwarg_names", tuple(self.qkv_kwarg_names))
        for i, index in enumerate(self.qkv_indices):
            check_int(_WHO, f"qkv_indices[{i}]", index,
                      fix="the positions of q, k, v in the module's arguments")
        check_int(_WHO, "seq_dim", self.seq_dim, fix="the sequence dim of q, k, v (1 for BSHD, 2 for BNSD)")
        check_int(_WHO, "head_dim", self.head_dim, fix="the heads dim of q, k, v (2 for BSHD, 1 for BNSD)")
        if self.seq_dim == self.head_dim:
            raise ValueError(f"seq_dim and head_dim must differ (got {self.seq_dim}); use 1/2 for BSHD, "
                             "2/1 for BNSD")
        if len(self.qkv_indices) != 3 and len(self.qkv_kwarg_names) < 3:
            raise ValueError(f"qkv_indices {self.qkv_indices} must name three positions (q, k, v)")


@dataclass(frozen=True)
class CPExchange:
    """The fixed mode: Ulysses degree (None: the whole CP mesh), K/V exchange, load balancing."""
    ulysses_degree: Optional[int] = None
    load_balance: bool = False
    kv_exchange: Literal["allgather", "ring"] = "allgather"

    def __post_init__(self) -> None:
        ds = self.ulysses_degree
        check_optional_int(_WHO, "ulysses_degree", ds, minimum=1,
                           fix="a positive int dividing the CP size, or None")
        if self.load_balance and ds != 1:
            raise ValueError(f"load_balance=True needs ulysses_degree=1 (all-gather KV), got "
                             f"ulysses_degree={ds!r}; set ulysses_degree=1 or load_balance=False")
        if self.kv_exchange not in KV_EXCHANGES:
            raise ValueError(f"kv_exchange={self.kv_exchange!r} is not one of {KV_EXCHANGES}")


@dataclass(frozen=True)
class CPOverlap:
    """overlap=True pipelines each call over ``chunks`` head groups (AsyncContextParallel)."""
    overlap: bool = False
    chunks: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "overlap", bool(self.overlap))
        check_int(_WHO, "chunks", self.chunks, minimum=1,
                  fix="the head groups overlap=True pipelines (1 turns the pipelining off)")


@dataclass(frozen=True)
class CPAuto:
    """``mode="auto"``'s options as given: None means not given (only mode='auto' takes them);
    ``causal_hint`` / ``tuned`` are the values the chooser uses."""
    mode: Optional[Literal["auto"]] = None
    memory_budget: Optional[float] = None
    calibration: Union[str, "os.PathLike[str]", None] = None
    causal: Optional[bool] = None
    tune: Optional[bool] = None

    def __post_init__(self) -> None:
        check_optional_float(_WHO, "memory_budget", self.memory_budget, positive=True,
                             fix="a positive number of bytes per rank, or None")
        if self.mode not in (None, "auto"):
            raise ValueError(f"mode={self.mode!r} is not supported: pass mode='auto' (chosen per shape), or "
                             f"leave it unset and choose with ulysses_degree / kv_exchange / load_balance")
        if self.mode != "auto":
            given = [n for n, v in (("memory_budget", self.memory_budget), ("calibration", self.calibration),
                                    ("causal", self.causal), ("tune", self.tune)) if v is not None]
            if given:
                raise ValueError(f"{given} only apply to mode='auto'; pass mode='auto' or drop them")

    @property
    def causal_hint(self) -> bool:
        """The cost model's causal hint (default: causal)."""
        return True if self.causal is None else bool(self.causal)

    @property
    def tuned(self) -> bool:
        """Time the close candidates on the call's shapes (default: yes)."""
        return True if self.tune is None else bool(self.tune)


@dataclass(frozen=True)
class ContextParallelConfig:
    """Every setting of one ContextParallel style."""
    layout: CPLayout = CPLayout()
    exchange: CPExchange = CPExchange()
    overlap: CPOverlap = CPOverlap()
    auto: CPAuto = CPAuto()

    def __post_init__(self) -> None:
        ex = self.exchange
        check_auto_exchange(self.auto, ex.ulysses_degree, ex.load_balance, ex.kv_exchange)


def check_auto_exchange(auto: CPAuto, ulysses_degree: object, load_balance: object,
                        kv_exchange: object) -> None:
    """mode='auto' chooses the exchange itself: refuse a fixed one. ContextParallel runs it before it
    builds its CPExchange, so the conflict is what is reported, not the exchange's own complaint."""
    if auto.mode != "auto":
        return
    fixed = [k for k, v in (("ulysses_degree", ulysses_degree), ("load_balance", load_balance),
                            ("kv_exchange", kv_exchange != "allgather")) if v]
    if fixed:
        raise ValueError(f"mode='auto' chooses ulysses_degree, kv_exchange and load_balance itself; "
                         f"drop {sorted(fixed)} or drop mode='auto'")
