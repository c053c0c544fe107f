"""The arguments of ``torch_npu.npu_fusion_attention`` and the geometry they describe.

Signature (torch_npu)::

    npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                         next_tockens=2147483647, inner_precise=0, prefix=None,
                         actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, ...)
    -> (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)

Layouts (N1 query heads = ``head_num``, N2 key/value heads, D head dim)::

    BSH  (B, S, N*D)    SBH (S, B, N*D)    BSND (B, S, N, D)    BNSD (B, N, S, D)
    TND  (T, N, D): sequences packed along T; ``actual_seq_qlen`` / ``actual_seq_kvlen`` are
         the cumulative end offsets of the sequences (e.g. [5, 12, 16] for lengths 5, 7, 4).

``softmax_max`` / ``softmax_sum`` are fp32 (B, N1, Sq, 8), in TND (T, N1, 8).
"""
from typing import Any
INT_MAX = 2147483647
_PARAMS = ("query", "key", "value", "head_num", "input_layout", "pse", "padding_mask", "atten_mask",
           "scale", "keep_prob", "pre_tockens", "next_tockens", "inner_precise", "prefix",
           "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode", "gen_mask_parallel", "sync")
_DEFAULTS = {"pse": None, "padding_mask": None, "atten_mask": None, "scale": 1.0, "keep_prob": 1.0,
             "pre_tockens": INT_MAX, "next_tockens": INT_MAX, "inner_precise": 0, "prefix": None,
             "actual_seq_qlen": None, "actual_seq_kvlen": None, "sparse_mode": 0}
# layout -> (batch dim, sequence dim, head dim (the hidden dim in BSH/SBH), heads packed in hidden)
LAYOUTS = {"BSH": (0, 1, 2, True), "SBH": (1, 0, 2, True), "BSND": (0, 1, 2, False),
           "BNSD": (0, 2, 1, False), "TND": (None, 0, 1, False)}


class NpuAttentionArgs:
    """The call's arguments by name; ``given`` are the names the caller passed (only those, and
    the ones the rule changes, are passed on, so the kernel's own defaults stay in charge)."""

    def __init__(self, args: Any, kwargs: Any) -> None:
        self.values, self.given, self.extra = dict(_DEFAULTS), [], {}
        for name, value in zip(_PARAMS, args):
            self.values[name] = value
            self.given.append(name)
        if len(args) > len(_PARAMS):
            raise ValueError(f"npu_fusion_attention: {len(args)} positional arguments, at most "
                             f"{len(_PARAMS)} are known")
        for name, value in kwargs.items():
            if name in _PARAMS:
                self.values[name] = value
                if name not in self.given:
                    self.given.append(name)
            else:
                self.extra[name] = value

    def __getitem__(self, name):
        return self.values.get(name)

    def replaced(self, **changes: Any) -> Any:
        out = NpuAttentionArgs((), {})
        out.values, out.given, out.extra = dict(self.values), list(self.given), dict(self.extra)
        for name, value in changes.items():
            out.values[name] = value
            if name not in out.given:
                out.given.append(name)
        return out

    def call(self, func: Any) -> Any:
        head = [self.values[n] for n in _PARAMS[:5]]
        kwargs = {n: self.values[n] for n in _PARAMS[5:] if n in self.given}
        kwargs.update(self.extra)
        return func(*head, **kwargs)


def as_int_list(value: Any) -> Any:
    """A list of ints from a list, tuple or tensor (``actual_seq_*len``); None stays None."""
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(x) for x in value]


def packed_sequence_ends(a: Any, geo: Any) -> Any:
    """(actual_seq_qlen, actual_seq_kvlen) as int lists, or ValueError unless they are cumulative
    sequence ends of equal length covering q's and k/v's T exactly."""
    cq, ckv = as_int_list(a["actual_seq_qlen"]), as_int_list(a["actual_seq_kvlen"])
    if cq is None or ckv is None or len(cq) != len(ckv) or not cq:
        raise ValueError("npu_fusion_attention: TND needs actual_seq_qlen and actual_seq_kvlen of equal "
                         "length (cumulative sequence ends)")
    if cq[-1] != geo.sq or ckv[-1] != geo.skv:
        raise ValueError(f"npu_fusion_attention: with T split over ranks the packed sequences must cover T "
                         f"exactly (actual_seq_qlen ends at {cq[-1]}, T={geo.sq}; actual_seq_kvlen ends at "
                         f"{ckv[-1]}, T={geo.skv})")
    return cq, ckv


class NpuAttentionGeometry:
    """Dims and sizes of one call: which q/k dim is batch, sequence and heads; N1, N2, D, Sq, Skv."""

    def __init__(self, layout: Any, q_shape: Any, k_shape: Any, head_num: Any) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"npu_fusion_attention: input_layout {layout!r} is not one of "
                             f"{', '.join(LAYOUTS)}")
        self.layout = layout
        self.batch: Any
        self.batch, self.seq, self.head, packed = LAYOUTS[layout]
        if len(q_shape) != (3 if layout in ("BSH", "SBH", "TND") else 4) or len(k_shape) != len(q_shape):
            raise ValueError(f"npu_fusion_attention: query {tuple(q_shape)} / key {tuple(k_shape)} do not "
                             f"match input_layout {layout}")
        self.n1 = int(head_num)
        if packed:
            self._packed_heads(q_shape, k_shape)
        else:
            if q_shape[self.head] != self.n1:
                raise ValueError(f"npu_fusion_attention: head_num={self.n1} but query has "
                                 f"{q_shape[self.head]} heads ({layout})")
            self.d = q_shape[-1]
            self.n2 = k_shape[self.head]
        self.sq, self.skv = q_shape[self.seq], k_shape[self.seq]
        self.q_shape = tuple(q_shape)

    def _packed_heads(self, q_shape, k_shape):
        """D and N2 of BSH/SBH, where the heads are packed in the hidden dim."""
        if q_shape[2] % self.n1:
            raise ValueError(f"npu_fusion_attention: hidden size {q_shape[2]} is not a multiple of "
                             f"head_num={self.n1} ({self.layout})")
        self.d = q_shape[2] // self.n1
        if k_shape[2] % self.d:
            raise ValueError(f"npu_fusion_attention: key hidden size {k_shape[2]} is not a multiple of "
                             f"the head dim {self.d} ({self.layout})")
        self.n2 = k_shape[2] // self.d

    def stats_shape(self) -> Any:
        """Shape of softmax_max / softmax_sum."""
        if self.layout == "TND":
            return (self.sq, self.n1, 8)
        return (self.q_shape[self.batch], self.n1, self.sq, 8)

    def stats_dim(self, dim: Any) -> Any:
        """The softmax_max/sum dim that a q tensor dim maps to."""
        if self.layout == "TND":
            return {0: 0, 1: 1}.get(dim)
        return {self.batch: 0, self.head: 1, self.seq: 2}.get(dim)
