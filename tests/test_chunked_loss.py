"""chunked_cross_entropy: the same loss and gradients as F.cross_entropy(hidden @ weight.T) — in one
process, in fp64 gradcheck, and with a vocab-parallel (Shard(0)) weight on 2 gloo ranks."""
import pytest
import torch
import torch.nn.functional as F

from hyper_parallel import chunked_cross_entropy
from tests.harness import run_dist

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(vocab=51, tokens=37, hidden=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, tokens, hidden, generator=g, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype) / hidden ** 0.5
    y = torch.randint(0, vocab, (2, tokens), generator=g)
    y[0, :5] = -100
    y[1, -1] = -100
    return h, w, y


def _plain(h, w, y, reduction):
    out = F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten(), reduction=reduction)
    return out.reshape(y.shape) if reduction == "none" else out


def _grads(fn, h, w, y, reduction, upstream):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(h, w, y, reduction)
    out.backward(upstream if reduction == "none" else None)
    return out.detach(), h.grad, w.grad


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_matches_plain_cross_entropy(reduction, chunk):
    h, w, y = _inputs()
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    chunked = (lambda *a: chunked_cross_entropy(*a[:3], chunk_size=chunk, reduction=a[3]))
    got = _grads(chunked, h, w, y, reduction, upstream)
    want = _grads(_plain, h, w, y, reduction, upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_gradcheck_fp64():
    h, w, y = _inputs(vocab=7, tokens=5, hidden=4, dtype=torch.float64)
    for reduction in ("sum", "mean", "none"):
        assert torch.autograd.gradcheck(
            lambda a, b: chunked_cross_entropy(a, b, y, chunk_size=3, reduction=reduction),
            (h.requires_grad_(), w.requires_grad_()))


def test_custom_ignore_index_and_all_ignored():
    h, w, y = _inputs()
    y[y == -100] = 3
    y[0, 7] = 3
    torch.testing.assert_close(chunked_cross_entropy(h, w, y, chunk_size=5, ignore_index=3, reduction="mean"),
                               F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten(), ignore_index=3), **TOL)
    none = torch.full_like(y, -100)
    assert chunked_cross_entropy(h, w, none, chunk_size=5).item() == 0.0
    # as F.cross_entropy: 0 / 0
    assert torch.isnan(chunked_cross_entropy(h, w, none, chunk_size=5, reduction="mean"))


@pytest.mark.parametrize("kwargs, words", [
    (dict(reduction="avg"), "reduction='avg'"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(ignore_index=1.5), "ignore_index=1.5"),
])
def test_bad_arguments_name_the_value(kwargs, words):
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        chunked_cross_entropy(h, w, y, **kwargs)


def test_bad_shapes_and_labels():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="labels.shape == hidden.shape"):
        chunked_cross_entropy(h, w, y[:, :-1])
    with pytest.raises(ValueError, match="weight's dim 1"):
        chunked_cross_entropy(h, w[:, :-1], y)
    y[1, 2] = 51
    with pytest.raises(ValueError, match="label 51 is outside"):
        chunked_cross_entropy(h, w, y)


def _vocab_parallel_case(rank, world_size, vocab):
    from hyper_parallel import Replicate, Shard, distribute_tensor, init_device_mesh
    from hyper_parallel.core.comm_mode import CommDebugMode
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    h, w, y = _inputs(vocab=vocab)
    for reduction in ("sum", "mean", "none"):
        upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        want = _grads(_plain, h, w, y, reduction, upstream)
        hh = h.clone().requires_grad_()
        ww = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
        with CommDebugMode() as comm:
            out = chunked_cross_entropy(hh, ww, y, chunk_size=16, reduction=reduction)
            out.backward(upstream if reduction == "none" else None)
        torch.testing.assert_close(out, want[0], **TOL)
        torch.testing.assert_close(hh.grad, want[1], **TOL)
        assert ww.grad.placements == (Shard(0),)
        torch.testing.assert_close(ww.grad.full_tensor(), want[2], **TOL)
        # 74 tokens = 5 tiles x (max, (sum_exp, target)) forward + the hidden gradient once; beside
        # them the TP ranks' agreement on the arguments (one shape_check at a combination's first call)
        assert comm.get_comm_counts() == {"all_reduce": 11, "shape_check": 1}, comm.get_comm_counts()
        assert comm.get_total_bytes() <= 2 * (74 * 3 * 4 + h.numel() * 4), comm.get_comm_bytes()
    with pytest.raises(ValueError, match="placements"):
        chunked_cross_entropy(h, distribute_tensor(w.clone(), mesh, [Shard(1)]), y)
    replicated = distribute_tensor(h.clone(), mesh, [Replicate()])
    torch.testing.assert_close(chunked_cross_entropy(replicated, distribute_tensor(w, mesh, [Shard(0)]), y),
                               _plain(h, w, y, "sum"), **TOL)
    return True


@pytest.mark.parametrize("vocab", [50, 51])
def test_vocab_parallel_weight_on_two_ranks(vocab):
    assert run_dist(2, _vocab_parallel_case, vocab) == [True, True]


def test_add_rows_default_matches_torch():
    """The contract's framework-neutral add_rows (a framework without index_add uses it) = torch's."""
    from hyper_parallel import get_platform
    from hyper_parallel.platform.long_sequence_contract import LongSequenceContract
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 7, (2500,), generator=g)      # repeats, and more than one block of rows
    source = torch.randn(2500, 3, generator=g)
    want = get_platform().add_rows(torch.zeros(7, 3), index, source)
    torch.testing.assert_close(LongSequenceContract.add_rows(get_platform(), torch.zeros(7, 3), index, source),
                               want, **TOL)
