"""Sharding rules for the ops real models hit (addmm, einsum, statistics, scans, index ops, losses,
norms, new_* factories): each on DTensors in several layouts, uneven shards included, against
torch on the full tensors, forward and gradients; and a tiny Hugging Face Llama training step under
TP=2 that must take no replicated fallback."""
import pytest

from tests.harness import run_dist


# ============================================================================ rule cases
# Each case: inputs (seeded, the same on every rank), the op, and layouts (one placement tuple per
# input, per mesh dim; None leaves an input a plain tensor). Sizes are chosen so that 4 ranks get
# uneven torch.chunk pieces, empty ones included (5 -> 2,2,1,0; 6 -> 2,2,2,0; 7 -> 2,2,2,1).
S, R, P = "S", "R", "P"


def _inputs(*shapes, ints=None):
    import torch
    g = torch.Generator().manual_seed(7)
    out = [torch.randn(s, generator=g) for s in shapes]
    return out + (ints or [])


def _ids(shape, high, seed=5):
    import torch
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _zero_row(x):
    x = x.clone()
    x[1] = 0
    return x


def _linear_algebra_cases():
    import torch
    return {
        "addmm": (lambda: _inputs((7,), (5, 6), (6, 7)),
                  lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0),
                  [["R", 0, "R"], ["R", 1, 0], [0, "R", 1], ["P", "P", "R"]]),
        "baddbmm": (lambda: _inputs((3, 5, 7), (3, 5, 6), (3, 6, 7)), torch.baddbmm,
                    [["R", 0, 0], [1, 1, "R"], ["R", 2, 1], [2, "R", 2]]),
        "addmv": (lambda: _inputs((5,), (5, 6), (6,)), torch.addmv, [["R", 0, "R"], ["R", 1, 0]]),
        "mv": (lambda: _inputs((5, 6), (6,)), torch.mv, [[0, "R"], [1, 0]]),
        # a size-1 input broadcast against a product whose piece is empty on the last rank
        "addmv_broadcast": (lambda: _inputs((1,), (5, 6), (6,)), torch.addmv, [["R", 0, "R"], ["P", 0, 0]]),
        "addmm_broadcast": (lambda: _inputs((1, 7), (5, 6), (6, 7)), torch.addmm,
                            [["R", 0, "R"], [1, "R", 1]]),
        "einsum_attention": (lambda: _inputs((2, 5, 6, 3), (2, 5, 7, 3)),
                             lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k),
                             [[1, 1], [3, 3], [2, "R"], ["P", "R"]]),
        "einsum_ellipsis": (lambda: _inputs((2, 5, 6), (6, 7)), lambda a, b: torch.einsum("...ij,jk", a, b),
                            [[1, "R"], [2, 0], ["R", 1]]),
        # a KV cache: keys split over heads (TP) grow along the sequence; and a cat along a split dim
        "cat_kv_cache": (lambda: _inputs((2, 5, 6, 3), (2, 5, 1, 3)), lambda k, new: torch.cat([k, new], 2),
                         [[1, 1], [2, "R"], [2, 2]]),
        "slice_seq": (lambda: _inputs((2, 5, 7, 3)), lambda k: k[:, :, 2:6], [[1], [2]]),
        # torchtitan's RoPE: pairs as complex numbers times the frequencies, back to real (heads split)
        "rope_complex": (lambda: _inputs((2, 6, 5, 4)) + [_freqs_cis(6, 2)], _rope,
                         [[2, "R"], [1, 0], [0, "R"]]),
    }


def _reduction_cases():
    import torch
    return {
        "var": (lambda: _inputs((5, 7)), lambda x: torch.var(x, 0), [[0], [1], ["P"]]),
        "var_legacy": (lambda: _inputs((7, 5)), lambda x: x.var(0, False, True), [[0], [1]]),
        "std_all": (lambda: _inputs((5, 7)), lambda x: torch.std(x, correction=0), [[0], [1]]),
        "std_zero": (lambda: [torch.ones(5, 3)], lambda x: torch.std(x, 0), [[0]]),
        "var_mean": (lambda: _inputs((6, 5, 2)), lambda x: torch.var_mean(x, (0, 2), keepdim=True),
                     [[0], [1]]),
        "std_mean": (lambda: _inputs((7, 3)), lambda x: torch.std_mean(x, 0, correction=2), [[0]]),
        "logsumexp": (lambda: _inputs((7, 5)), lambda x: torch.logsumexp(x, 0), [[0], [1], ["P"]]),
        "logsumexp_inf": (lambda: [_with_infs()], lambda x: torch.logsumexp(x, 1, keepdim=True), [[1], [0]]),
        "vector_norm_2": (lambda: [_zero_row(_inputs((7, 5))[0]).t().contiguous()],
                          lambda x: torch.linalg.vector_norm(x, dim=1), [[1], [0]]),
        "vector_norm_3": (lambda: _inputs((7, 5)), lambda x: torch.linalg.vector_norm(x, 3, dim=0), [[0]]),
        "vector_norm_1_all": (lambda: _inputs((7, 5)), lambda x: torch.linalg.vector_norm(x, 1),
                              [[0], ["P"]]),
        "vector_norm_inf": (lambda: _inputs((7, 5)), lambda x: torch.linalg.vector_norm(x, float("inf"), 0),
                            [[0]]),
        "vector_norm_half": (lambda: _inputs((7, 5)), lambda x: torch.linalg.vector_norm(x, 0.5, 0),
                             [[0], [1]]),
        "torch_norm_fro": (lambda: _inputs((7, 5)), lambda x: torch.norm(x), [[0], [1]]),
        "tensor_norm_dim": (lambda: _inputs((7, 5)), lambda x: x.norm(3, 0, keepdim=True), [[0], [1]]),
        "argmax": (lambda: _inputs((7, 5)), lambda x: torch.argmax(x, 0), [[0], [1]]),
        "argmin_all": (lambda: _inputs((7, 5)), torch.argmin, [[0]]),
        "topk": (lambda: _inputs((7, 5)), lambda x: torch.topk(x, 2, dim=1), [[0], [1]]),
        "sort": (lambda: _inputs((7, 5)), lambda x: torch.sort(x, dim=0, descending=True), [[0], [1]]),
        "cumsum": (lambda: _inputs((7, 5)), lambda x: torch.cumsum(x, 0), [[0], [1], ["P"]]),
        "prod": (lambda: _inputs((7, 5)), lambda x: torch.prod(x, 1), [[0], [1]]),
    }


def _loss_and_index_cases():
    import torch
    import torch.nn.functional as F
    ignored = _ids((10,), 5).masked_fill(_ids((10,), 3, 1) == 0, -100)
    return {
        "nll_loss_mean": (lambda: _inputs((10, 5), ints=[ignored]), lambda x, t: F.nll_loss(x, t),
                          [[0, "R"], ["R", 0], [1, "R"], ["P", "R"]]),
        "nll_loss_weight": (lambda: _inputs((10, 5), (5,), ints=[_ids((10,), 5)]),
                            lambda x, w, t: F.nll_loss(x, t, weight=w.detach().abs()), [[0, "R", 0]]),
        "nll_loss_3d": (lambda: _inputs((2, 5, 7), ints=[_ids((2, 7), 5)]),
                        lambda x, t: F.nll_loss(x, t, reduction="sum"), [[2, "R"], ["R", 1]]),
        "nll_loss_none": (lambda: _inputs((10, 5), ints=[_ids((10,), 5)]),
                          lambda x, t: F.nll_loss(x, t, reduction="none"), [[0, "R"]]),
        "mse_loss": (lambda: _inputs((5, 7), (5, 7)), F.mse_loss, [[0, "R"], [1, 1], ["P", "R"]]),
        "mse_loss_sum_broadcast": (lambda: _inputs((5, 7), (7,)),
                                   lambda a, b: F.mse_loss(a, b.expand(5, 7), reduction="sum"),
                                   [[0, "R"], [1, 0]]),
        "index_select": (lambda: _inputs((7, 5), ints=[_ids((6,), 7)]),
                         lambda x, i: torch.index_select(x, 0, i),
                         [[1, "R"], [0, "R"], ["R", 0], ["P", "R"]]),
        "gather": (lambda: _inputs((6, 5), ints=[_ids((6, 3), 5)]), lambda x, i: torch.gather(x, 1, i),
                   [[0, "R"], ["R", 0], [1, "R"]]),
        "gather_rows": (lambda: _inputs((6, 5), ints=[_ids((7, 5), 6)]), lambda x, i: torch.gather(x, 0, i),
                        [["R", 0], [1, 1], [0, "R"]]),
        "scatter_add": (lambda: _inputs((6, 5), (6, 2), ints=[_ids((6, 2), 5)]),
                        lambda x, s, i: torch.scatter_add(x, 1, i, s),
                        [[0, 0, "R"], ["R", "R", 0], [1, "R", "R"]]),
        # where / masked_fill are elementwise: exact for every placement and broadcast
        "where_broadcast": (lambda: _inputs((5, 7), (7,), ints=[_ids((5, 1), 2) == 1]),
                            lambda x, y, c: torch.where(c, x, y),
                            [[0, "R", "R"], ["P", 0, "R"], [1, 0, 0], ["R", "P", 0]]),
        "masked_fill_broadcast": (lambda: _inputs((5, 7), ints=[_ids((7,), 2) == 1]),
                                  lambda x, m: x.masked_fill(m, -1.5),
                                  [[0, "R"], [1, 0], ["P", "R"], ["R", 0]]),
        "new_zeros_same": (lambda: _inputs((7, 5)), lambda x: x.new_zeros(7, 5), [[0], [1], ["P"]]),
        "new_full_other": (lambda: _inputs((7, 5)), lambda x: x.new_full((3, 4), 2.5), [[0]]),
        "new_ones_other": (lambda: _inputs((7, 5)), lambda x: x.new_ones((2,)) + 1, [[1]]),
    }


def _case_table():
    """name -> (inputs builder, op, layouts); a layout: per input, "R", "P" (Partial sum) or an int
    (Shard(dim)), applied on one mesh dim at a time (the others replicated)."""
    return {**_linear_algebra_cases(), **_reduction_cases(), **_loss_and_index_cases()}


def _freqs_cis(seq, half):
    import torch
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), 1.0 / (10000 ** (torch.arange(half) / half)))
    return torch.polar(torch.ones_like(angles), angles)


def _rope(x, freqs):
    import torch
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.view(1, freqs.shape[0], 1, freqs.shape[1])).flatten(3)


def _with_infs():
    import torch
    inf = float("inf")
    return torch.tensor([[-inf, -inf, -inf], [1.0, 2.0, -inf], [0.5, 3.0, 1.0], [-inf, -inf, -inf],
                         [2.0, 1.0, 0.0]]).t().contiguous()


def _placements(spec, mesh_ndim, mesh_dim_of_first):
    from hyper_parallel import Partial, Replicate, Shard
    if spec == "R":
        one = Replicate()
    elif spec == "P":
        one = Partial("sum")
    else:
        one = Shard(spec)
    # on a 2-D mesh the layout applies on mesh dim ``mesh_dim_of_first``, the other stays replicated
    return tuple(one if m == mesh_dim_of_first else Replicate() for m in range(mesh_ndim))


def _make(x, placements, mesh):
    """A DTensor whose full value is ``x``; a Partial(sum) one in unequal pieces (1/3, 2/3, ...)."""
    from hyper_parallel import DTensor, Replicate, distribute_tensor
    base = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(x, mesh, base, src_data_rank=None).to_local().clone()
    for m, p in enumerate(placements):
        if p.is_partial():
            n, c = mesh.size(m), mesh.get_coordinate()[m]
            local = local * ((c + 1) / (n * (n + 1) / 2))
    return DTensor.from_local(local, mesh, placements, shape=tuple(x.shape))


def _flat(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _check_case(rank, world_size, mesh_shape, name, table=None):
    """Every layout of case ``name`` (of ``table()``, default this file's): forward values, shapes,
    local pieces and the gradient of every floating input equal torch on the full tensors, and no op
    takes the replicated fallback."""
    import torch
    from hyper_parallel import DTensor, init_device_mesh
    from hyper_parallel.core.dtensor.dispatch.fallback import recording_fallbacks

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    build, op, layouts = (table or _case_table)()[name]
    for mesh_dim in range(mesh.ndim):
        for layout in layouts:
            tag = f"{name} {layout} on mesh dim {mesh_dim}"
            full = build()
            refs = [x.clone().requires_grad_(x.is_floating_point()) for x in full]
            want = _flat(op(*refs))
            dts = [_make(x, _placements(p, mesh.ndim, mesh_dim), mesh) for x, p in zip(full, layout)]
            for d in dts:
                d.requires_grad_(d.is_floating_point())
            with recording_fallbacks() as fallbacks:
                got = _flat(op(*dts))
                assert len(got) == len(want), tag
                loss_w = [torch.randn(tuple(w.shape), generator=torch.Generator().manual_seed(i))
                          for i, w in enumerate(want)]
                grads_wanted = [w for w in want if w.is_floating_point() and w.requires_grad]
                for g, w, lw in zip(got, want, loss_w):
                    assert isinstance(g, DTensor), tag
                    assert tuple(g.to_local().shape) == g._spec.local_shape, (tag, g.placements)
                    torch.testing.assert_close(g.full_tensor(), w, atol=1e-5, rtol=1e-5, equal_nan=True,
                                               msg=lambda m: f"{tag}: {m}")
                if grads_wanted:
                    sum((w * lw).sum() for w, lw in zip(want, loss_w) if w.requires_grad).backward()
                    sum((g.full_tensor() * lw).sum() for g, w, lw in zip(got, want, loss_w)
                        if w.requires_grad).backward()
            assert not fallbacks, f"{tag}: took the fallback for {sorted(fallbacks)}"
            if grads_wanted:
                for i, (r, d) in enumerate(zip(refs, dts)):
                    if r.grad is not None:
                        torch.testing.assert_close(d.grad.full_tensor(), r.grad, atol=1e-5, rtol=1e-5,
                                                   msg=lambda m: f"{tag} gradient of input {i}: {m}")
    return True


def _check_all(rank, world_size, mesh_shape):
    names = sorted(_case_table())
    for name in names:
        _check_case(rank, world_size, mesh_shape, name)
    return names


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_rules_match_one_device(mesh_shape):
    names = run_dist(4, _check_all, mesh_shape, timeout=900)
    assert len(names[0]) >= 40 and all(n == names[0] for n in names)


def _communication(rank, world_size):
    """The exact split reductions move only small all-reduces (no all-gather of the input); new_*
    factories and a KV-cache concatenation along the sequence of head-split keys move nothing."""
    import torch
    from hyper_parallel import CommDebugMode, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    x = distribute_tensor(torch.randn(10, 6), mesh, [Shard(0)])
    keys = distribute_tensor(torch.randn(2, 4, 6, 3), mesh, [Shard(1)])  # heads split (TP)
    counts = {}
    for name, fn in {"var": lambda: torch.var(x, 0), "std_mean": lambda: torch.std_mean(x, 0),
                     "logsumexp": lambda: torch.logsumexp(x, 0),
                     "vector_norm": lambda: torch.linalg.vector_norm(x, dim=0),
                     "new_zeros": lambda: x.new_zeros((3, 3)), "new_ones": lambda: x.new_ones((10, 6)),
                     "kv_cache_cat": lambda: torch.cat([keys, keys[:, :, :1]], 2)}.items():
        with CommDebugMode() as comm:
            fn()
        counts[name] = dict(comm.get_comm_counts())
    return counts


def _strided_alignment(rank, world_size):
    """A batch (or contraction) dim split as StridedShard on one operand and as a plain Shard on the
    other: the rule must bring both to one kind (their pieces would hold different rows)."""
    import torch
    from hyper_parallel import Shard, distribute_tensor, init_device_mesh
    from hyper_parallel.core.dtensor.placement_types import StridedShard
    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 3, 4, generator=g), torch.randn(8, 4, 5, generator=g)
    ops = {"bmm": torch.bmm, "matmul": torch.matmul,
           "einsum": lambda x, y: torch.einsum("bij,bjk->bik", x, y),
           "contract": lambda x, y: torch.einsum("bij,bjk->ik", x, y)}
    for name, fn in ops.items():
        da = distribute_tensor(a, mesh, [StridedShard(0, 2), Shard(0)])
        db = distribute_tensor(b, mesh, [Shard(0), Shard(0)])
        torch.testing.assert_close(fn(da, db).full_tensor(), fn(a, b), msg=lambda m: f"{name}: {m}")
    return True


def test_strided_and_plain_shards_of_one_dim_are_aligned():
    assert run_dist(4, _strided_alignment) == [True] * 4


def test_split_reductions_only_all_reduce():
    counts = run_dist(2, _communication)[0]
    for name in ("var", "std_mean", "logsumexp", "vector_norm"):
        assert set(counts[name]) == {"all_reduce"}, (name, counts[name])
    for name in ("new_zeros", "new_ones", "kv_cache_cat"):
        assert counts[name] == {}, (name, counts[name])


# ============================================================================ Llama: no fallback
def _llama_step(rank, world_size, hf_loss=False, cache=False):
    """One forward + backward of a tiny LlamaForCausalLM under TP=2: loss and every gradient equal
    the single-process model's, and the names of the ops that took the fallback are returned."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    from hyper_parallel import DTensor, init_device_mesh
    from hyper_parallel.core.dtensor.dispatch.fallback import recording_fallbacks
    from hyper_parallel.integrations.transformers import parallelize_model

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)

    def loss_of(model):
        if hf_loss:  # transformers' own ForCausalLMLoss (shift, pad, cross_entropy(sum) / count)
            return model(input_ids=ids, labels=ids, use_cache=cache).loss
        logits = model(input_ids=ids, use_cache=cache).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    torch.manual_seed(0)
    ref = LlamaForCausalLM(config).float()
    ref_loss = loss_of(ref)
    ref_loss.backward()
    torch.manual_seed(0)
    model = parallelize_model(LlamaForCausalLM(config).float(), init_device_mesh("cpu", (2,),
                                                                                 mesh_dim_names=("tp",)))
    with recording_fallbacks() as names:
        loss = loss_of(model)
        loss.backward()
    full = loss.full_tensor() if isinstance(loss, DTensor) else loss
    torch.testing.assert_close(full, ref_loss, atol=1e-5, rtol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    return sorted(names)


@pytest.mark.parametrize("hf_loss,cache", [(False, False), (True, False), (True, True)])
def test_llama_tp2_training_step_takes_no_fallback(hf_loss, cache):
    pytest.importorskip("transformers")
    assert run_dist(2, _llama_step, hf_loss, cache) == [[], []]
