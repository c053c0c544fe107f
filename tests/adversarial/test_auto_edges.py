"""ContextParallel(mode="auto") where it used to fail (issue 36 item 5): its first call (the one that
calibrates) inside ``attention_masks``, under no_grad or through parallelize_model with a padding
mask — exact against one process; a calibration file with a NaN, an infinity, a negative or missing
number — a ValueError naming the file and the field on every rank; element sizes from the platform
(float8 is one byte, not free)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_dist

TOL = dict(rtol=1e-5, atol=1e-5)


class _Core(torch.nn.Module):
    """Causal SDPA on (batch, seq, heads, dim) q, k, v, as an attention module calls it."""

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _dense_reference(q, k, v, documents, padding):
    """One process: causal + same document + real key, by a dense (B, 1, S, S) mask; a query row that
    sees no key gives 0 (as the masked kernels and torch's SDPA give)."""
    seq = q.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    visible = causal & (documents[:, :, None] == documents[:, None, :]) & padding[:, None, :]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def _fresh_calibration():
    """Forget the calibrations earlier cases in this worker made: the next call calibrates."""
    from hyper_parallel.core.context_parallel.auto import calibration
    calibration._MEASURED.clear()


def _masked_first_call(rank, world_size, seq, heads, calibration):
    from hyper_parallel import ContextParallel, attention_masks, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(2, seq, heads, 8, generator=g, dtype=torch.float64) for _ in range(3))
    documents = torch.tensor([[0] * 5 + [1] * (seq - 5), [0] * (seq // 2) + [1] * (seq - seq // 2)])
    padding = torch.ones(2, seq, dtype=torch.bool)
    padding[1, -3:] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _dense_reference(*leaves, documents, padding)
    upstream = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, leaves, upstream)
    block = slice(rank * (seq // world_size), (rank + 1) * (seq // world_size))
    _fresh_calibration()      # without a file, the first call calibrates: inside the masks, under no_grad
    style = ContextParallel(mode="auto", calibration=calibration)
    core = parallelize_module(_Core(), mesh, style)
    local = [t[:, block].clone().requires_grad_() for t in (q, k, v)]
    with attention_masks(document_ids=documents, padding_mask=padding):
        with torch.no_grad():
            torch.testing.assert_close(core(*local), ref[:, block].detach(), **TOL)
        out = core(*local)
    torch.testing.assert_close(out, ref[:, block].detach(), **TOL)
    for got, want in zip(torch.autograd.grad(out, local, upstream[:, block]), ref_grads):
        torch.testing.assert_close(got, want[:, block], **TOL)
    return style.last_choice.mode, sorted(style.last_choice.predicted_seconds)


def test_auto_first_call_inside_masks_calibrates_outside_them():
    results = run_dist(2, _masked_first_call, 16, 2, None)
    assert all(r == results[0] for r in results), results    # every rank chose alike


def test_auto_under_masks_four_ranks_offers_every_mode(tmp_path):
    path = _write(tmp_path / "cal.json", GOOD)
    results = run_dist(4, _masked_first_call, 16, 4, path)
    assert all(r == results[0] for r in results), results
    # every mode runs under the masks, so none is dropped from the choice (hybrids included)
    assert {"ulysses", "allgather", "ring", "hybrid(ds=2)"} <= set(results[0][1]), results[0]


def _hf_padding_first_call(rank, world_size):
    from tests.test_hf_masks import _every_mode
    _fresh_calibration()
    return _every_mode(rank, world_size, {"auto": {"cp_mode": "auto"}})


def test_auto_first_call_under_parallelize_model_with_padding():
    pytest.importorskip("transformers")
    assert run_dist(2, _hf_padding_first_call) == [True, True]


def test_default_compute_state_leaves_the_callers():
    from hyper_parallel import get_platform
    platform = get_platform()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        with platform.default_compute_state():
            assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            assert not torch.is_autocast_enabled("cpu")
        assert not torch.is_grad_enabled() and torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------------ calibration files
GOOD = {"flops": 1e10, "ds_bandwidth": 1e9, "ds_latency": 1e-5, "co_bandwidth": 1e9, "co_latency": 1e-5,
        "contention": 1.0, "overlap": 0.5, "overheads": {"ulysses": 1e-4},
        "collectives": {"all_to_all/ds/2": [1e-9, 1e-5]}}
BAD = [("flops", math.nan), ("flops", math.inf), ("flops", 0), ("ds_bandwidth", 0.0), ("co_bandwidth", -1e9),
       ("ds_latency", -1.0), ("co_latency", math.nan), ("contention", -math.inf), ("overlap", 2.0),
       ("flops", "fast"), ("flops", True), ("overheads", {"ulysses": math.nan}),
       ("collectives", {"all_to_all/ds/2": [1e-9]}), ("collectives", {"all_to_all/ds/2": [math.inf, 0.0]})]


def _write(path, values):
    # json writes NaN / Infinity as JavaScript literals, which json.load reads back: what a file may hold
    path.write_text(json.dumps(values))
    return str(path)


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_calibration_number_names_file_and_field(tmp_path, field, value):
    from hyper_parallel.core.context_parallel.auto.calibration import Machine
    path = _write(tmp_path / "cal.json", {**GOOD, field: value})
    with pytest.raises(ValueError, match=rf"calibration file {path}: {field}"):
        Machine.load(path)


def test_missing_or_unreadable_calibration_file(tmp_path):
    from hyper_parallel.core.context_parallel.auto.calibration import Machine
    values = dict(GOOD)
    del values["co_latency"]
    path = _write(tmp_path / "old.json", values)
    with pytest.raises(ValueError, match=rf"calibration file {path} lacks \['co_latency'\]"):
        Machine.load(path)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=rf"calibration file {broken} cannot be read as JSON"):
        Machine.load(str(broken))
    assert Machine.load(_write(tmp_path / "good.json", GOOD)).overlap == 0.5


def _nan_file_on_every_rank(rank, world_size, path):
    from hyper_parallel import ContextParallel, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    core = parallelize_module(_Core(), mesh, ContextParallel(mode="auto", calibration=path))
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match=r"cal.json: ds_bandwidth = nan"):
        core(q, q, q)
    return True


def test_nan_calibration_raises_on_every_rank(tmp_path):
    path = _write(tmp_path / "cal.json", {**GOOD, "ds_bandwidth": math.nan})
    assert run_dist(2, _nan_file_on_every_rank, path) == [True, True]


# ------------------------------------------------------------------ element sizes
@pytest.mark.parametrize("dtype,size", [(torch.float8_e4m3fn, 1), (torch.float8_e5m2, 1), (torch.bfloat16, 2),
                                        (torch.float32, 4), (torch.float64, 8)])
def test_itemsize_comes_from_the_platform(dtype, size):
    from hyper_parallel import ContextParallel
    from hyper_parallel.core.context_parallel.auto.chooser import call_shape
    from hyper_parallel.core.context_parallel.auto.cost_model import Candidate, _held_bytes
    q = torch.zeros(1, 8, 2, 4, dtype=dtype)
    shape = call_shape(ContextParallel(), (q, q, q), 2, True)
    assert shape.itemsize == size
    # float8 traffic is priced at a byte an element, not free
    assert _held_bytes(shape, 2, Candidate("allgather", 1, "allgather", False)) == 1 * 2 * 16 * 8 * size
