"""loss_parallel(): the vocab-parallel cross-entropy equals F.cross_entropy on one device for every
argument torch takes -- or raises what torch raises, on every rank (before any collective, so no
rank is left waiting in one).

Every rank builds the full logits and targets, computes torch's loss and logits gradient locally,
and compares them with the DTensor path on class-sharded logits (even, uneven and empty shards).
"""
import pytest

from tests.harness import run_dist

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _configs(vocab):
    """(name, logits shape, target kind, kwargs): every F.cross_entropy argument, alone and mixed."""
    out = []
    for shape in ((vocab,), (6, vocab), (2, vocab, 3), (2, vocab, 2, 2)):
        for reduction in ("mean", "sum", "none"):
            for eps in (0.0, 0.2):
                out.append((f"{len(shape)}-D {reduction} eps={eps}", shape, "labels",
                            dict(reduction=reduction, label_smoothing=eps)))
            out.append((f"{len(shape)}-D {reduction} ignore_index=1", shape, "labels",
                        dict(reduction=reduction, ignore_index=1, label_smoothing=0.1)))
            out.append((f"{len(shape)}-D {reduction} weight", shape, "labels",
                        dict(reduction=reduction, weight=True, label_smoothing=0.1)))
            if len(shape) > 1:
                out.append((f"{len(shape)}-D {reduction} all ignored", shape, "ignored",
                            dict(reduction=reduction)))
                out.append((f"{len(shape)}-D {reduction} all ignored eps", shape, "ignored",
                            dict(reduction=reduction, label_smoothing=0.3)))
            out.append((f"{len(shape)}-D {reduction} probabilities", shape, "soft",
                        dict(reduction=reduction, label_smoothing=0.1)))
    return out


def _target(torch, kind, shape, vocab, gen, ignore_index):
    class_shape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    if kind == "soft":
        return torch.softmax(torch.randn(shape, generator=gen), 0 if len(shape) == 1 else 1)
    if kind == "ignored":
        return torch.full(class_shape, -100, dtype=torch.long)
    labels = torch.randint(0, vocab, class_shape, generator=gen)
    if labels.numel() > 1:
        labels.view(-1)[1] = ignore_index
    return labels


def _sharded(x, mesh, dim):
    """A leaf DTensor of ``x`` sharded on ``dim`` (torch.chunk's uneven pieces, empty ones too)."""
    from hyper_parallel import DTensor, Shard, distribute_tensor
    local = distribute_tensor(x, mesh, [Shard(dim)], src_data_rank=None).to_local().clone()
    return DTensor.from_local(local, mesh, [Shard(dim)], shape=x.shape).requires_grad_()


def _compare_case(rank, world_size):
    """Forward (NaN positions included) and logits gradient on 1-D..4-D logits for every
    reduction / ignore_index / weight / label_smoothing / probability-target combination."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import CommDebugMode, DTensor, Replicate, init_device_mesh, loss_parallel

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    checked = 0
    for vocab in (16, 10, 3):   # even; uneven (4 ranks: 3, 3, 3, 1); fewer classes than 4 ranks
        for name, shape, kind, kw in _configs(vocab):
            what = f"vocab={vocab} {name}"
            gen = torch.Generator().manual_seed(checked)
            x = torch.randn(shape, generator=gen)
            target = _target(torch, kind, shape, vocab, gen, kw.get("ignore_index", -100))
            kw = dict(kw)
            if kw.get("weight"):
                kw["weight"] = torch.rand(vocab, generator=gen) + 0.5
            x_ref = x.clone().requires_grad_()
            loss_ref = F.cross_entropy(x_ref, target, **kw)
            cot = torch.randn(loss_ref.shape, generator=gen)
            (loss_ref * cot).sum().backward()

            class_dim = 0 if len(shape) == 1 else 1
            dx = _sharded(x, mesh, class_dim)
            with CommDebugMode() as comm:
                with loss_parallel():
                    loss = F.cross_entropy(dx, target, **kw)
                (loss.full_tensor() * cot).sum().backward()
            assert isinstance(loss, DTensor) and tuple(loss.placements) == (Replicate(),), what
            torch.testing.assert_close(loss.full_tensor(), loss_ref.detach(), equal_nan=True, **TOL,
                                       msg=lambda m: f"{what} loss: {m}")
            torch.testing.assert_close(dx.grad.full_tensor(), x_ref.grad, equal_nan=True, **TOL,
                                       msg=lambda m: f"{what} logits grad: {m}")
            if "weight" not in kw:   # vocab-parallel: the logits are never gathered
                assert "all_gather" not in comm.get_comm_counts(), (what, comm.get_comm_counts())
            checked += 1
    return checked


def _errors_case(rank, world_size):
    """Bad inputs raise torch's error on every rank, and the ranks stay in step afterwards."""
    import torch
    import torch.nn.functional as F
    from hyper_parallel import init_device_mesh, loss_parallel

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    vocab = 10
    x = torch.randn(4, vocab)
    dx = _sharded(x, mesh, 1)
    good = torch.tensor([0, 3, 9, -100])
    bad = [
        (torch.tensor([0, vocab, 1, 2]), {}),                               # label == vocab
        (torch.tensor([0, -1, 1, 2]), {}),                                  # negative, not ignored
        (torch.tensor([0, 1, 2, 10 * vocab]), {"label_smoothing": 0.1}),
        (torch.tensor([0, vocab, 1, 2]), {"reduction": "none"}),
        (torch.tensor([0, -100, 1, 2]), {"ignore_index": 3}),              # -100 is not ignored here
        (torch.tensor([0, 1, 2]), {}),                                      # batch size mismatch
        (good.clamp(min=0).float(), {}),                                    # float labels, wrong shape
        (good, {"label_smoothing": 1.5}),
        (good, {"reduction": "mean-ish"}),
    ]
    raised = []
    for target, kw in bad:
        with pytest.raises(Exception) as want:
            F.cross_entropy(x, target, **kw)
        with pytest.raises(type(want.value)) as got:
            with loss_parallel():
                F.cross_entropy(dx, target, **kw)
        raised.append(type(got.value).__name__)
        if isinstance(want.value, IndexError):
            assert "out of bounds" in str(got.value), got.value
    # the ranks are still in step: a valid call works afterwards
    with loss_parallel():
        loss = F.cross_entropy(dx, good)
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(x, good), **TOL)
    # int32 labels (MindSpore's usual dtype) are taken as labels, where torch asks for int64
    with loss_parallel():
        loss = F.cross_entropy(dx, good.clamp(min=0).int())
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(x, good.clamp(min=0)), **TOL)
    return raised


@pytest.mark.parametrize("world_size", [2, 4])
def test_loss_parallel_equals_single_device(world_size):
    counts = run_dist(world_size, _compare_case, timeout=400)
    assert counts[0] == 3 * len(_configs(4)) and len(set(counts)) == 1, counts


def test_loss_parallel_bad_inputs_raise_like_torch():
    raised = run_dist(4, _errors_case, timeout=120)
    assert all(r == raised[0] for r in raised), raised
    assert raised[0][:5] == ["IndexError"] * 5, raised[0]
