"""The long-sequence helpers where they used to go wrong (issue 36 item 4), each against one process:
tiled_mlp under tensor + sequence parallelism (the torchtitan plan of examples/train_llama_titan.py),
on a Hugging Face MoE block with batch > 1 or called by keyword; chunked_cross_entropy with a
vocab-parallel weight that leaves a rank no vocab rows, and with per-class weights."""
import pytest
import torch
import torch.nn.functional as F

from hyper_parallel import chunked_cross_entropy, tiled_mlp
from tests.harness import run_dist

TOL = dict(rtol=1e-5, atol=1e-5)
DIM, HIDDEN = 8, 16


class _FeedForward(torch.nn.Module):
    """torchtitan's FeedForward (w2(silu(w1 x) * w3 x)) under its own module names."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(torch.nn.Module):
    """The MLP half of a torchtitan block: h = x + feed_forward(ffn_norm(x))."""

    def __init__(self):
        super().__init__()
        self.ffn_norm = torch.nn.RMSNorm(DIM)
        self.feed_forward = _FeedForward()

    def forward(self, x):
        return x + self.feed_forward(self.ffn_norm(x))


def _titan_plan(local_output):
    """The feed-forward entries of examples/train_llama_titan.py's tp_plan (local_output=True is its
    plan: the residual stream is this rank's local sequence shard)."""
    from hyper_parallel import (ColwiseParallel, PrepareModuleInput, Replicate, RowwiseParallel,
                                SequenceParallel, Shard)
    return {"ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w[13]": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=local_output)}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tiled_tp_sp_table(rank, world_size, table):
    from hyper_parallel import DTensor, Shard, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for chunks, seq, local_output in table:
        torch.manual_seed(seq)
        ref = _Block()
        torch.nn.init.normal_(ref.ffn_norm.weight)
        block = _Block()
        block.load_state_dict(ref.state_dict())
        parallelize_module(block, mesh, _titan_plan(local_output))
        tiled_mlp(block.feed_forward, chunks)
        g = torch.Generator().manual_seed(1)
        x, upstream = torch.randn(2, seq, DIM, generator=g), torch.randn(2, seq, DIM, generator=g)
        lo, n = rank * seq // world_size, seq // world_size
        x_ref = x.clone().requires_grad_()
        (ref(x_ref) * upstream).sum().backward()
        x_local = x[:, lo:lo + n].clone().requires_grad_()
        if local_output:   # the plan's residual stream: plain tensors, this rank's tokens
            out = block(x_local)
            assert type(out) is torch.Tensor
            torch.testing.assert_close(out, ref(x)[:, lo:lo + n], **TOL)
            (out * upstream[:, lo:lo + n]).sum().backward()
        else:              # the stream as Shard(1) DTensors: the output is one too, in global order
            out = block(DTensor.from_local(x_local, mesh, [Shard(1)]))
            torch.testing.assert_close(out.full_tensor(), ref(x), **TOL)
            (out.to_local() * upstream[:, lo:lo + n]).sum().backward()
        torch.testing.assert_close(x_local.grad, x_ref.grad[:, lo:lo + n], **TOL)
        for (name, p), (_, q) in zip(block.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=lambda m: f"{name}: {m}")
    return True


def test_tiled_mlp_under_tp_sequence_parallel_equals_one_process():
    # tiles that split evenly over the ranks and tiles that do not; the stream local and as DTensors
    table = [(2, 8, True), (5, 12, True), (3, 12, False), (5, 12, False)]
    assert run_dist(2, _tiled_tp_sp_table, table) == [True] * 2


# ------------------------------------------------------------------ tiled_mlp on MoE blocks, by keyword
def _moe_block(kind):
    block = _moe_block_uninitialised(kind)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():     # Hugging Face leaves the experts' weights uninitialised (torch.empty)
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block


def _moe_block_uninitialised(kind):
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                                num_attention_heads=2, num_key_value_heads=2, intermediate_size=32)
        return Qwen3MoeSparseMoeBlock(config)
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                           num_attention_heads=2, num_key_value_heads=2)
    return MixtralSparseMoeBlock(config)


def _grads(module, x, by_keyword):
    x = x.clone().requires_grad_()
    out = module(hidden_states=x) if by_keyword else module(x)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * upstream).sum().backward()
    grads = [x.grad] + [p.grad for p in module.parameters()]
    module.zero_grad()
    return out.detach(), grads


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_tiled_mlp_on_hf_moe_block_batch_and_keyword(kind):
    plain, tiled = _moe_block(kind), _moe_block(kind)
    tiled_mlp(tiled, 3)
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(1))
    for by_keyword in (False, True):
        want, want_grads = _grads(plain, x, by_keyword)
        got, got_grads = _grads(tiled, x, by_keyword)
        torch.testing.assert_close(got, want, **TOL)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, **TOL)


class _Router(torch.nn.Module):
    """A MoE block of the older Hugging Face form: (hidden, router logits of the flattened tokens)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(16, 5)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, hidden_states, scale=1.0):
        logits = self.gate(hidden_states.view(-1, 16))
        return self.proj(hidden_states) * scale, logits


def test_tiled_mlp_joins_tuples_and_flattened_outputs():
    torch.manual_seed(0)
    plain, tiled = _Router(), _Router()
    tiled.load_state_dict(plain.state_dict())
    tiled_mlp(tiled, 4)
    x = torch.randn(2, 9, 16)
    for got, want in zip(tiled(x, scale=2.0), plain(x, scale=2.0)):
        torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(ValueError, match="without its input"):
        tiled(scale=2.0)


def test_tiled_mlp_refuses_outputs_it_cannot_join():
    class Pool(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=1)     # not token-local: no tile layout to join
    with pytest.raises(ValueError, match="cannot be joined"):
        tiled_mlp(Pool(), 2)(torch.randn(2, 6, 4))


# ------------------------------------------------------------------ chunked_cross_entropy
def _ce_inputs(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 9, 6, generator=g)
    w = torch.randn(vocab, 6, generator=g)
    y = torch.randint(0, vocab, (2, 9), generator=g)
    y[0, :2] = -100
    return h, w, y, torch.rand(vocab, generator=g) + 0.1


def _plain_ce(h, w, y, reduction, class_weight):
    out = F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten(), weight=class_weight, reduction=reduction)
    return out.reshape(y.shape) if reduction == "none" else out


def _ce_grads(fn, h, w, y, reduction, class_weight):
    h = h.clone().requires_grad_()
    w_leaf = w.clone().requires_grad_() if not hasattr(w, "device_mesh") else w
    out = fn(h, w_leaf, y, reduction, class_weight)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * upstream).sum().backward()
    return out.detach(), h.grad, _full(w_leaf.grad)


def _chunked(h, w, y, reduction, class_weight):
    return chunked_cross_entropy(h, w, y, chunk_size=4, reduction=reduction, class_weight=class_weight)


def _empty_shard_table(rank, world_size, table):
    from hyper_parallel import Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for vocab, reduction, weighted in table:
        h, w, y, cw = _ce_inputs(vocab)
        cw = cw if weighted else None
        w_tp = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        got = _ce_grads(_chunked, h, w_tp, y, reduction, cw)
        want = _ce_grads(_plain_ce, h, w, y, reduction, cw)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)
    return True


def _four_ranks(rank, world_size, tp_sp_table, empty_shard_table):
    tiled = _tiled_tp_sp_table(rank, world_size, tp_sp_table)
    return tiled and _empty_shard_table(rank, world_size, empty_shard_table)


def test_four_ranks_tiled_mlp_and_empty_vocab_shards_are_exact():
    # one pool call: tiled_mlp under TP + SP (tiles of 12 tokens over 4 ranks: 3 each; of 4: 1 each),
    # and vocab 3 (rank 3 holds no rows) / 5 (rows 2, 2, 1, 0) with and without class weights
    tp_sp = [(3, 12, True), (3, 12, False)]
    empty = [(3, "mean", True), (5, "none", True), (5, "sum", False)]
    assert run_dist(4, _four_ranks, tp_sp, empty) == [True] * 4


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_class_weight_equals_cross_entropy_weight(reduction):
    h, w, y, cw = _ce_inputs(11)
    got, want = _ce_grads(_chunked, h, w, y, reduction, cw), _ce_grads(_plain_ce, h, w, y, reduction, cw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_class_weight_mistakes_are_named():
    h, w, y, cw = _ce_inputs(11)
    with pytest.raises(ValueError, match="pass per-class weights .* as class_weight="):
        chunked_cross_entropy(h, w, y, weight=cw)
    with pytest.raises(ValueError, match="label_smoothing not supported"):
        chunked_cross_entropy(h, w, y, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"class_weight has shape \(4,\)"):
        chunked_cross_entropy(h, w, y, class_weight=cw[:4])
    with pytest.raises(ValueError, match="class_weight requires grad"):
        chunked_cross_entropy(h, w, y, class_weight=cw.clone().requires_grad_())
    # the projection weight by keyword is still the projection weight
    torch.testing.assert_close(chunked_cross_entropy(h, labels=y, weight=w), _plain_ce(h, w, y, "sum", None),
                               **TOL)
