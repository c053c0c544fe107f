"""Tensor parallelism: styles, parallelize_module, loss_parallel on a Llama-style block.

Every distributed case builds the same model on every rank from one seed, runs the unsharded
reference in-process and compares (fp32, 1e-5). Checks are grouped into a few ``run_dist`` calls
(each a round trip to the worker pool). The Colwise -> Rowwise MLP is platform-neutral
(tests/cases/tensor_parallel.py) and runs on torch and on MindSpore Cells.
"""
import pytest

from tests.cases import tensor_parallel as neutral
from tests.harness import run_dist
from tests.harness.frameworks import framework_worlds, run_on

DIM, HEADS, HEAD_DIM, FFN = 32, 4, 8, 64
BATCH, SEQ = 2, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}


# ============================================================================ models
def _data_counts(comm):
    """Collectives other than from_local's one-time cross-rank "shape_check" (first call of a
    signature in the process: whether a case sees it depends on what ran before in the pool)."""
    return {op: n for op, n in comm.get_comm_counts().items() if op != "shape_check"}


def _models():
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, bias=False):
            super().__init__()
            self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=bias)
            self.wk = nn.Linear(DIM, HEADS * HEAD_DIM, bias=bias)
            self.wv = nn.Linear(DIM, HEADS * HEAD_DIM, bias=bias)
            self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=bias)

        def forward(self, x):
            b, s, _ = x.shape
            # -1 heads: the local head count under tensor parallelism
            q = self.wq(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
            k = self.wk(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
            v = self.wv(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(o.transpose(1, 2).reshape(b, s, -1))

    class FeedForward(nn.Module):
        def __init__(self, bias=False):
            super().__init__()
            self.w1 = nn.Linear(DIM, FFN, bias=bias)
            self.w3 = nn.Linear(DIM, FFN, bias=bias)
            self.w2 = nn.Linear(FFN, DIM, bias=bias)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self, bias=False):
            super().__init__()
            self.attention_norm = nn.RMSNorm(DIM, eps=1e-6)
            self.attention = Attention(bias)
            self.ffn_norm = nn.RMSNorm(DIM, eps=1e-6)
            self.feed_forward = FeedForward(bias)

        def forward(self, x):
            h = x + self.attention(self.attention_norm(x))
            return h + self.feed_forward(self.ffn_norm(h))

    return Block


def _block(bias=False, seed=0):
    import torch
    torch.manual_seed(seed)
    block = _models()(bias)
    with torch.no_grad():  # non-trivial norm weights
        for norm in (block.attention_norm, block.ffn_norm):
            norm.weight.uniform_(0.5, 1.5)
    return block


def _tp_plan():
    """The Llama-block plan of docs/tensor_parallel.md (no sequence parallelism)."""
    from hyper_parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from hyper_parallel.core.dtensor import Replicate
    replicated_input = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    return {
        "attention": replicated_input,
        "attention.w[qkv]": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward": replicated_input,
        "feed_forward.w[13]": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def _naive_tp_plan():
    """Only the Linear layers: correct, one more backward all-reduce per extra colwise layer."""
    from hyper_parallel import ColwiseParallel, RowwiseParallel
    return {"*.w[qkv13]": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}


def _sp_plan():
    """The Llama-block plan with sequence parallelism (norms on sequence shards)."""
    from hyper_parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                SequenceParallel)
    from hyper_parallel.core.dtensor import Replicate, Shard
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.w[qkv]": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w[13]": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


# ============================================================================ helpers
def _close(actual, expected, what, **tol):
    import torch
    tol = tol or TOL
    try:
        torch.testing.assert_close(actual, expected, **tol)
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from None


def _full(t):
    from hyper_parallel import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _placements(module):
    from hyper_parallel import DTensor
    return {n: tuple(p.placements) for n, p in module.named_parameters() if isinstance(p, DTensor)}


def _train_and_compare(model, ref, mesh, make_input, gather_output, steps=3, what=""):
    """Forward, every parameter gradient and (after ``steps`` AdamW steps) the output of the
    parallel ``model`` against ``ref``. Returns the comm counts of the second forward/backward: the
    steady state (the first step also runs from_local's one-time "shape_check" per signature)."""
    import torch
    from hyper_parallel import CommDebugMode

    torch.manual_seed(7)
    x = torch.randn(BATCH, SEQ, DIM)
    grad_out = torch.randn(BATCH, SEQ, DIM)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    counts = {}
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        x_ref = x.clone().requires_grad_()
        out_ref = ref(x_ref)
        (out_ref * grad_out).sum().backward()

        x_in, g_in = make_input(x), make_input(grad_out)
        x_in = x_in.detach().requires_grad_()
        with CommDebugMode() as fwd:
            out = model(x_in)
        _close(gather_output(out), out_ref, f"{what} forward (step {step})")
        with CommDebugMode() as bwd:
            (out * g_in).sum().backward()
        _close(gather_output(x_in.grad), x_ref.grad, f"{what} input grad (step {step})")
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            _close(_full(param.grad), ref_params[name].grad, f"{what} grad of {name} (step {step})")
        if step == 1:
            counts = {"forward": fwd.get_comm_counts(), "backward": bwd.get_comm_counts()}
        opt.step()
        ref_opt.step()
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        _close(_full(param.detach()), ref_params[name].detach(), f"{what} {name} after {steps} AdamW steps")
    with torch.no_grad():
        _close(gather_output(model(make_input(x))), ref(x), f"{what} output after {steps} AdamW steps")
    return counts


# ============================================================================ Llama block: TP and SP
def _llama_case(rank, world_size):
    import copy

    import torch
    from hyper_parallel import DTensor, init_device_mesh, parallelize_module
    from hyper_parallel.core.dtensor import Replicate, Shard
    from hyper_parallel.platform import get_platform

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    group = mesh.get_group(0)
    platform = get_platform()
    chunk = SEQ // world_size
    results = {}

    # --- TP with the documented plan
    ref = _block()
    model = parallelize_module(copy.deepcopy(ref), mesh, _tp_plan())
    placements = _placements(model)
    assert placements["attention.wq.weight"] == (Shard(0),), placements
    assert placements["attention.wo.weight"] == (Shard(1),), placements
    assert placements["feed_forward.w1.weight"] == (Shard(0),), placements
    assert placements["feed_forward.w2.weight"] == (Shard(1),), placements
    assert "attention_norm.weight" not in placements  # not parallelized: a plain parameter
    assert model.attention.wq.weight.to_local().shape == (HEADS * HEAD_DIM // world_size, DIM)
    results["tp"] = _train_and_compare(model, ref, mesh, lambda t: t, lambda t: t, what="TP")

    # state_dict holds DTensors whose full_tensor() is the unsharded weight
    sd = model.state_dict()
    assert isinstance(sd["attention.wo.weight"], DTensor)
    _close(sd["attention.wo.weight"].full_tensor(), ref.attention.wo.weight.detach(), "state_dict")

    # --- TP with only the Linear layers named (fnmatch over segments), with biases, and SGD
    ref = _block(bias=True)
    model = parallelize_module(copy.deepcopy(ref), mesh, _naive_tp_plan())
    placements = _placements(model)
    assert placements["attention.wk.bias"] == (Shard(0),)
    assert placements["attention.wo.bias"] == (Replicate(),)
    assert placements["feed_forward.w3.weight"] == (Shard(0),), placements
    torch.manual_seed(3)
    x = torch.randn(BATCH, SEQ, DIM)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        _close(_full(param.detach()), ref_params[name].detach(), f"naive TP {name} after SGD")

    # --- sequence parallel + TP: each rank feeds and gets back its sequence chunk
    ref = _block()
    model = parallelize_module(copy.deepcopy(ref), mesh, _sp_plan())
    placements = _placements(model)
    assert placements["attention_norm.weight"] == (Replicate(),)
    assert placements["ffn_norm.weight"] == (Replicate(),)

    def local_chunk(t):
        return t[:, rank * chunk:(rank + 1) * chunk]

    def gather(t):
        assert not isinstance(t, DTensor) and t.shape[1] == chunk, type(t)
        return platform.all_gather(t.detach().contiguous(), group, dim=1)

    results["sp"] = _train_and_compare(model, ref, mesh, local_chunk, gather, what="SP")
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_llama_block_tp_and_sequence_parallel(world_size):
    results = run_dist(world_size, _llama_case, timeout=180)
    for counts in results:
        tp, sp = counts["tp"], counts["sp"]
        # TP: exactly one all-reduce per RowwiseParallel output (wo, w2), nothing else
        assert tp["forward"] == {"all_reduce": 2}, tp
        # backward: one all-reduce of the input gradient per PrepareModuleInput (attention, MLP)
        assert tp["backward"] == {"all_reduce": 2}, tp
        # SP: an all-gather into each TP region, a reduce-scatter out of it; mirrored in backward
        assert sp["forward"] == {"all_gather": 2, "reduce_scatter": 2}, sp
        assert sp["backward"].get("all_gather") == 2 and sp["backward"].get("reduce_scatter") == 2, sp
        # ... plus the norm-weight gradients, summed over the sequence shards
        assert sp["backward"].get("all_reduce", 0) == 2, sp


# ============================================================================ embedding + loss_parallel
def _embedding_loss_case(rank, world_size):
    import copy

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from hyper_parallel import (ColwiseParallel, CommDebugMode, DTensor, RowwiseParallel, init_device_mesh,
                                loss_parallel, parallelize_module)
    from hyper_parallel.core.dtensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    vocab, dim = 16, 8
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ))
    grad_out = torch.randn(BATCH, SEQ, dim)

    # --- Embedding colwise (weight Shard(1), output Shard(-1)) and rowwise (Shard(0), Partial -> R)
    for style, out_layout in ((ColwiseParallel(), "shard"),
                              (ColwiseParallel(output_layouts=Replicate()), "full"),
                              (RowwiseParallel(), "full"),
                              (RowwiseParallel(output_layouts=Shard(1)), "seq")):
        torch.manual_seed(2)
        ref = nn.Embedding(vocab, dim, padding_idx=3)
        emb = parallelize_module(copy.deepcopy(ref), mesh, style)
        expected_w = (Shard(1),) if isinstance(style, ColwiseParallel) else (Shard(0),)
        assert tuple(emb.weight.placements) == expected_w
        with CommDebugMode() as comm:
            out = emb(ids)
        out_ref = ref(ids)
        assert not isinstance(out, DTensor)
        d, s = dim // world_size, SEQ // world_size
        if out_layout == "shard":
            want, g = out_ref[..., rank * d:(rank + 1) * d], grad_out[..., rank * d:(rank + 1) * d]
            assert _data_counts(comm) == {}, comm.get_comm_counts()
        elif out_layout == "seq":
            want, g = out_ref[:, rank * s:(rank + 1) * s], grad_out[:, rank * s:(rank + 1) * s]
            assert _data_counts(comm) == {"reduce_scatter": 1}, comm.get_comm_counts()
        else:
            want, g = out_ref, grad_out
            expected = {"all_reduce": 1} if isinstance(style, RowwiseParallel) else {"all_gather": 1}
            assert _data_counts(comm) == expected, comm.get_comm_counts()
        _close(out, want, f"embedding {style} forward")
        (out * g).sum().backward()
        (out_ref * grad_out).sum().backward()
        _close(emb.weight.grad.full_tensor(), ref.weight.grad, f"embedding {style} weight grad")

    # --- vocab-parallel output head + loss_parallel (uneven vocab on 4 ranks: 3, 3, 3, 1)
    for vocab in (16, 10):
        torch.manual_seed(4)
        ref = nn.Sequential(nn.RMSNorm(DIM), nn.Linear(DIM, vocab, bias=False))
        head = copy.deepcopy(ref)
        parallelize_module(head, mesh, {"1": ColwiseParallel(use_local_output=False)})
        x = torch.randn(BATCH, SEQ, DIM)
        labels = torch.randint(0, vocab, (BATCH, SEQ))
        labels[0, :2] = -100
        soft = torch.softmax(torch.randn(BATCH * SEQ, vocab), -1)
        cases = [dict(), dict(reduction="sum"), dict(reduction="none"), dict(label_smoothing=0.1),
                 dict(ignore_index=5, reduction="none", label_smoothing=0.2)]
        cases += [dict(soft=True), dict(soft=True, label_smoothing=0.1, reduction="none"),
                  dict(class_dim_1=True, reduction="none")]  # (B, V, S) logits, (B, S) labels
        for kw in cases:
            kw = dict(kw)
            use_soft = kw.pop("soft", False)
            class_dim_1 = kw.pop("class_dim_1", False)
            target = soft if use_soft else labels if class_dim_1 else labels.flatten()
            shape_for_loss = (lambda t: t.transpose(1, 2)) if class_dim_1 else (lambda t: t.flatten(0, 1))
            if kw.get("ignore_index") == 5:  # the ignored positions hold 5 instead of -100
                target = target.masked_fill(target < 0, 5)
            for m in (ref, head):
                m.zero_grad()
            x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
            logits_ref = ref(x_ref)
            loss_ref = F.cross_entropy(shape_for_loss(logits_ref), target, **kw)
            w = torch.randn(loss_ref.shape) if loss_ref.ndim else torch.tensor(1.0)
            (loss_ref * w).sum().backward()
            with CommDebugMode() as comm:
                logits = head(x_tp)
                assert isinstance(logits, DTensor) and tuple(logits.placements) == (Shard(2),)
                with loss_parallel():
                    loss = F.cross_entropy(shape_for_loss(logits), target, **kw)
                assert isinstance(loss, DTensor) and tuple(loss.placements) == (Replicate(),)
                (loss.to_local() * w).sum().backward()
            what = f"loss_parallel vocab={vocab} {kw} soft={use_soft} class_dim_1={class_dim_1}"
            _close(loss.to_local(), loss_ref.detach(), what)
            _close(x_tp.grad, x_ref.grad, f"{what}: input grad")
            _close(head[1].weight.grad.full_tensor(), ref[1].weight.grad, f"{what}: head grad")
            _close(head[0].weight.grad, ref[0].weight.grad, f"{what}: norm grad")
            counts = _data_counts(comm)
            assert "all_gather" not in counts and "all_to_all" not in counts, (what, counts)
            # forward: all-reduce(max) + one stacked all-reduce(sum); backward: the colwise input grad
            assert counts == {"all_reduce": 3}, (what, counts)

        # without loss_parallel: correct too (the class dim is gathered)
        head.zero_grad()
        logits = head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        _close(loss.full_tensor(), F.cross_entropy(ref(x).flatten(0, 1), labels.flatten()).detach(),
               "cross_entropy without loss_parallel")
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_embedding_and_loss_parallel(world_size):
    assert run_dist(world_size, _embedding_loss_case, timeout=180) == [True] * world_size


# ============================================================================ 2-D mesh, errors, misc styles
def _mesh_2d_case(rank, world_size):
    import copy

    import torch
    import torch.nn as nn
    from hyper_parallel import ColwiseParallel, DTensor, RowwiseParallel, init_device_mesh, parallelize_module
    from hyper_parallel.core.dtensor import Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    dp_rank = mesh.get_local_rank("dp")

    # a 2-D mesh without slicing: a clear error pointing at mesh["tp"], before any collective
    with pytest.raises(ValueError, match=r'mesh\["tp"\]'):
        parallelize_module(_block(), mesh, _tp_plan())
    with pytest.raises(ValueError, match=r'mesh\["tp"\]'):
        ColwiseParallel().apply(nn.Linear(4, 4), mesh)
    # unsupported module types name the module and the supported ones
    with pytest.raises(ValueError, match="LayerNorm") as err:
        parallelize_module(nn.LayerNorm(4), tp, ColwiseParallel())
    assert "LayerNorm" in str(err.value) and "nn.Linear and nn.Embedding" in str(err.value)
    with pytest.raises(ValueError, match="Conv1d"):
        parallelize_module(nn.Sequential(nn.Conv1d(2, 2, 1)), tp, {"0": RowwiseParallel()})
    with pytest.raises(ValueError, match="src_data_rank"):
        parallelize_module(nn.Linear(4, 4), tp, ColwiseParallel(), src_data_rank=2)
    with pytest.raises(ValueError, match="device_mesh"):
        parallelize_module(nn.Linear(4, 4), None, ColwiseParallel())
    with pytest.warns(UserWarning, match="matched no submodule"):
        parallelize_module(nn.Sequential(nn.Linear(4, 4)), tp, {"nothing.here": ColwiseParallel()})

    # TP on mesh["tp"] inside `with tp:` (current-mesh default); each dp replica its own batch
    ref = _block()
    with tp:
        model = parallelize_module(copy.deepcopy(ref), parallelize_plan=_tp_plan())
    assert model.attention.wq.weight.device_mesh == tp
    torch.manual_seed(100 + dp_rank)
    x = torch.randn(BATCH, SEQ, DIM)
    out = model(x)
    out_ref = ref(x)
    _close(out, out_ref, "2-D mesh (dp=2, tp=2) forward")
    out.pow(2).sum().backward()
    out_ref.pow(2).sum().backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _close(_full(p.grad), ref_params[name].grad, f"2-D mesh grad of {name}")

    # src_data_rank: ranks start from different weights; the source rank's weight is used everywhere
    torch.manual_seed(50 + rank)
    lin = nn.Linear(4, 6)
    parallelize_module(lin, tp, ColwiseParallel(), src_data_rank=1)  # the 2nd rank of each tp group
    assert isinstance(lin.weight, DTensor) and tuple(lin.weight.placements) == (Shard(0),)
    torch.manual_seed(50 + tp.rank_list[1])
    expected = nn.Linear(4, 6)
    _close(lin.weight.full_tensor(), expected.weight.detach(), "src_data_rank weight")
    _close(lin.bias.full_tensor(), expected.bias.detach(), "src_data_rank bias")
    # None: each rank slices its own copy (no communication)
    torch.manual_seed(50 + rank)
    mine = nn.Linear(4, 6)
    w = mine.weight.detach().clone()
    parallelize_module(mine, tp, RowwiseParallel(), src_data_rank=None)
    t = tp.get_local_rank()
    _close(mine.weight.to_local(), w[:, t * 2:(t + 1) * 2], "src_data_rank=None shard")
    return True


def _styles_case(rank, world_size):
    import copy

    import torch
    import torch.nn as nn
    from hyper_parallel import (ColwiseParallel, CommDebugMode, DTensor, NoParallel, PrepareModuleInput,
                                PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                                init_device_mesh, parallelize_module)
    from hyper_parallel.core.dtensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))

    class TwoInputs(nn.Module):
        def forward(self, a, b, *, scale=None):
            out = a + b
            return out * scale if scale is not None else out

    torch.manual_seed(9)
    a, b, scale = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    n = 6 // world_size
    cols = slice(rank * n, (rank + 1) * n)

    # PrepareModuleInput with a kwarg: local shards of a / scale (Shard(1)), b replicated
    mod = parallelize_module(TwoInputs(), mesh, PrepareModuleInput(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"scale": Shard(1)}, desired_input_kwarg_layouts={"scale": Replicate()}))
    seen = {}
    mod.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(a=args[0], b=args[1], scale=kwargs["scale"]), with_kwargs=True)
    out = mod(a[:, cols], b, scale=scale[:, cols])
    assert isinstance(seen["a"], DTensor) and tuple(seen["a"].placements) == (Replicate(),)
    assert not isinstance(seen["b"], DTensor)
    assert isinstance(out, DTensor)
    _close(out.full_tensor(), (a + b) * scale, "PrepareModuleInput kwargs")

    # PrepareModuleOutput: a plain output taken as Replicate, returned as local Shard(1)
    mod = parallelize_module(TwoInputs(), mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                    desired_output_layouts=Shard(1)))
    out = mod(a, b)
    assert not isinstance(out, DTensor)
    _close(out, (a + b)[:, cols], "PrepareModuleOutput")

    # PrepareModuleInputOutput: Shard(0) rows in, DTensor all-gathered back to Replicate out
    mod = parallelize_module(TwoInputs(), mesh, PrepareModuleInputOutput(
        input_layouts=(Shard(0), Shard(0)), desired_input_layouts=(Shard(0), Shard(0)),
        output_layouts=Shard(0), desired_output_layouts=Replicate(), use_local_output=False))
    r = 4 // world_size
    rows = slice(rank * r, (rank + 1) * r)
    with CommDebugMode() as comm:
        out = mod(a[rows], b[rows])
    assert isinstance(out, DTensor) and tuple(out.placements) == (Replicate(),)
    assert _data_counts(comm) == {"all_gather": 1}, comm.get_comm_counts()
    _close(out.to_local(), a + b, "PrepareModuleInputOutput")

    # NoParallel: replicated DTensor parameters, plain tensors in and out, replicated grads
    torch.manual_seed(11)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    model = parallelize_module(copy.deepcopy(ref), mesh, {"0": NoParallel(), "1": NoParallel()})
    assert all(isinstance(p, DTensor) and tuple(p.placements) == (Replicate(),) for p in model.parameters())
    with CommDebugMode() as comm:
        out = model(a)
    assert _data_counts(comm) == {} and not isinstance(out, DTensor)
    _close(out, ref(a), "NoParallel forward")
    out.sum().backward()
    ref(a).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert tuple(p.grad.placements) == (Replicate(),)
        _close(p.grad.to_local(), q.grad, f"NoParallel grad {name}")

    # Colwise -> Rowwise MLP keeping DTensors (use_local_output=False) between the layers
    torch.manual_seed(12)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
    model = parallelize_module(copy.deepcopy(ref), mesh, {
        "0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel(use_local_output=False)})
    out = model(a)
    assert isinstance(out, DTensor) and tuple(out.placements) == (Replicate(),)
    _close(out.to_local(), ref(a), "Colwise/Rowwise DTensor chain")

    # re-parallelizing a module with another layout is an error
    lin = parallelize_module(nn.Linear(4, 4), mesh, ColwiseParallel())
    with pytest.raises(ValueError, match="already a DTensor"):
        parallelize_module(lin, mesh, RowwiseParallel())
    return True


def test_2d_mesh_and_errors():
    assert run_dist(4, _mesh_2d_case, timeout=180) == [True] * 4


def test_other_styles():
    assert run_dist(2, _styles_case, timeout=120) == [True] * 2


# ============================================================================ in-process checks
def test_style_arguments_are_validated():
    from hyper_parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel,
                                SequenceParallel)
    from hyper_parallel.core.dtensor import Replicate, Shard

    assert ColwiseParallel().input_layouts == Replicate() and ColwiseParallel().output_layouts == Shard(-1)
    assert RowwiseParallel().output_layouts == Replicate()
    assert ColwiseParallel(input_layouts=(Shard(1),)).input_layouts == Shard(1)
    with pytest.raises(ValueError, match="one placement"):
        ColwiseParallel(input_layouts=(Shard(1), Replicate()))
    with pytest.raises(ValueError, match="placement"):
        RowwiseParallel(output_layouts="replicate")
    with pytest.raises(ValueError, match="one entry per input"):
        PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),))
    with pytest.raises(ValueError, match="same keyword"):
        PrepareModuleInput(input_kwarg_layouts={"a": Shard(0)}, desired_input_kwarg_layouts={})
    with pytest.raises(ValueError, match="one entry per output"):
        PrepareModuleOutput(output_layouts=(Shard(0),), desired_output_layouts=(Replicate(), Replicate()))
    with pytest.raises(ValueError, match="int"):
        SequenceParallel(sequence_dim="1")


def test_public_names():
    import hyper_parallel
    from hyper_parallel.core import tensor_parallel
    for name in ("ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
                 "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "NoParallel",
                 "parallelize_module", "loss_parallel"):
        assert getattr(hyper_parallel, name) is getattr(tensor_parallel, name)


# ============================================================================ on every framework
@pytest.mark.parametrize("framework,kind", [
    ("torch", "linear"),
    pytest.param("mindspore", "mint", marks=pytest.mark.mindspore),
    pytest.param("mindspore", "dense", marks=pytest.mark.mindspore)])
def test_colwise_rowwise_mlp(framework, kind):
    """nn.Linear (torch), mint.nn.Linear and nn.Dense (MindSpore): forward with one all-reduce,
    input and parameter gradients, the forward after an SGD step."""
    names = run_on(framework, 2, neutral.colwise_rowwise, kind, timeout=280)
    assert names[0] == ["w1.bias", "w1.weight", "w2.bias", "w2.weight"]


@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4))
def test_embedding_rowwise_and_colwise(framework, world_size):
    """torch nn.Embedding and MindSpore nn.Embedding (its ``embedding_table``) under both styles."""
    done = run_on(framework, world_size, neutral.embedding_styles, timeout=280)
    assert [len(d) for d in done] == [2] * world_size
