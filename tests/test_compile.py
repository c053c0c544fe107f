"""torch.compile of parallelized modules (SPEC §18, docs/compile.md).

Every case compiles with ``compile_module`` and compares forward and every gradient with the same
parallelized module run eagerly (fp32, 1e-5), for two or three steps. Graph structure is asserted,
never time: ``torch._dynamo.explain`` of the compiled region (one graph, no break), and the
AOTAutograd forward / backward graphs (functional collectives, no eager c10d op). Compiling on 2
cores is slow: the default run uses the ``aot_eager`` backend (AOTAutograd traces exactly what
inductor would compile) except for one inductor case; ``-m compile_full`` adds inductor everywhere.
"""
import pytest

from tests.harness import run_dist
from tests.test_tensor_parallel import _block, _sp_plan, _tp_plan

TOL = {"atol": 1e-5, "rtol": 1e-5}
DIM, SEQ, BATCH = 32, 8, 2


# ============================================================================ helpers
class _Recorder:
    """A torch.compile backend: AOTAutograd (as inductor runs it) whose forward and backward
    graphs are kept as code text; ``inner`` compiles them (None: run the graphs as they are)."""

    def __init__(self, inductor=False):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner
        self.graphs = []

        def record(gm, example_inputs):
            self.graphs.append(gm.code)
            return make_boxed_func(gm.forward)

        def record_inductor(gm, example_inputs, **kwargs):
            self.graphs.append(gm.code)
            return compile_fx_inner(gm, example_inputs, **kwargs)
        if inductor:
            def backend(gm, example_inputs):
                return compile_fx(gm, example_inputs, inner_compile=record_inductor)
            self.backend = backend
        else:
            self.backend = aot_autograd(fw_compiler=record, bw_compiler=record)

    def collectives(self):
        return [[op for op in ("all_reduce", "all_gather_into_tensor", "all_to_all_single")
                 if f"_c10d_functional.{op}" in code] for code in self.graphs]

    def eager_c10d(self):
        return [code for code in self.graphs if "torch.ops.c10d." in code]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _close(actual, expected, what):
    import torch
    torch.testing.assert_close(_full(actual), _full(expected), **TOL, msg=lambda m: f"{what}: {m}")


def _compare_steps(compiled, eager, make_inputs, steps, what):
    """``steps`` forward/backward/AdamW steps of both modules on the same inputs: outputs, input
    gradients and every parameter gradient (same type: DTensor gradients stay DTensors)."""
    import torch
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (compiled, eager)]
    for step in range(steps):
        grads = []
        for module, opt in zip((compiled, eager), opts):
            opt.zero_grad()
            inputs, weight = make_inputs(step)
            out = module(*inputs)
            (out * weight).sum().backward()
            grads.append((out, [x.grad for x in inputs]))
        (out_c, in_c), (out_e, in_e) = grads
        _close(out_c, out_e, f"{what} output, step {step}")
        for i, (a, b) in enumerate(zip(in_c, in_e)):
            _close(a, b, f"{what} grad of input {i}, step {step}")
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            assert type(p.grad) is type(q.grad), f"{what} {name}: {type(p.grad)} vs {type(q.grad)}"
            _close(p.grad, q.grad, f"{what} grad of {name}, step {step}")
        for opt in opts:
            opt.step()


def _inputs(step, parts=1, index=0):
    """The block's input and the loss weight of ``step`` (the same on every rank; ``parts`` > 1:
    this rank's sequence block)."""
    import torch
    gen = torch.Generator().manual_seed(step)
    x, w = torch.randn(BATCH, SEQ, DIM, generator=gen), torch.randn(BATCH, SEQ, DIM, generator=gen)
    x, w = x.chunk(parts, 1)[index], w.chunk(parts, 1)[index]
    return [x.clone().requires_grad_()], w


def _explain(module, *inputs):
    from hyper_parallel.platform.torch.compile_support import compiled_of
    ex = compiled_of(module).explain(*inputs)
    return ex.graph_count, ex.graph_break_count


# ============================================================================ TP (+ SP) block
def _tp_case(rank, world, inductor, plans=("tp", "sp")):
    import copy

    from hyper_parallel import init_device_mesh, parallelize_module
    from hyper_parallel.platform.torch.compile_support import compile_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = {}
    for name, plan, sp in (("tp", _tp_plan, False), ("sp", _sp_plan, True)):
        if name not in plans:
            continue
        ref = _block()
        eager = parallelize_module(copy.deepcopy(ref), mesh, plan())
        recorder = _Recorder(inductor)
        compiled = compile_module(parallelize_module(copy.deepcopy(ref), mesh, plan()),
                                  backend=recorder.backend)

        def make_inputs(step):
            return _inputs(step, world if sp else 1, rank if sp else 0)
        _compare_steps(compiled, eager, make_inputs, 2, name)
        results[name] = {"explain": _explain(compiled, make_inputs(0)[0][0]),
                         "collectives": recorder.collectives(), "eager_c10d": recorder.eager_c10d(),
                         "graphs": len(recorder.graphs)}
    return results


def _check_tp(results):
    for name, res in results[0].items():
        assert res["explain"] == (1, 0), f"{name}: (graphs, breaks) = {res['explain']}"
        assert res["graphs"] == 2, f"{name}: one forward and one backward graph, got {res['graphs']}"
        assert res["eager_c10d"] == [], f"{name}: an eager c10d op was traced"
    # TP: the row-wise outputs all-reduce in forward, the column-wise inputs' gradients in backward;
    # SP: all-gathers of the sequence in forward, their reduce-scatters (an all-to-all on gloo) back
    if "tp" in results[0]:
        tp = results[0]["tp"]["collectives"]
        assert "all_reduce" in tp[0] and "all_reduce" in tp[1], tp
    if "sp" in results[0]:
        sp = results[0]["sp"]["collectives"]
        assert "all_gather_into_tensor" in sp[0] and "all_to_all_single" in sp[0], sp
        assert "all_gather_into_tensor" in sp[1] and "all_to_all_single" in sp[1], sp


def test_tp_sp_block_compiles_without_breaks():
    """The Llama block under TP + SP (column- and row-wise layers, sequence-parallel norms): one
    graph, no break, functional collectives in both directions; two AdamW steps equal eager
    (AOTAutograd's graphs run as traced)."""
    _check_tp(run_dist(2, _tp_case, False, ("sp",), timeout=600))


@pytest.mark.compile_full
def test_tp_sp_block_inductor():
    """TP without SP as well, with inductor generating the code (slow to build on 2 cores)."""
    _check_tp(run_dist(2, _tp_case, True, timeout=900))


# ============================================================================ direct torch.compile
def _direct_case(rank, world):
    """``torch.compile(block)`` without compile_module: correct, with a graph break at each DTensor
    call (counted, as docs/compile.md states)."""
    import copy

    import torch
    from hyper_parallel import init_device_mesh, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = _block()
    eager = parallelize_module(copy.deepcopy(ref), mesh, _tp_plan())
    compiled = parallelize_module(copy.deepcopy(ref), mesh, _tp_plan())
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    direct = torch.compile(compiled, backend=counting)
    _compare_steps(direct, eager, _inputs, 2, "torch.compile(block)")
    return len(graphs)


@pytest.mark.compile_full
def test_direct_torch_compile_is_correct_with_breaks():
    graphs = run_dist(2, _direct_case, timeout=600)
    assert graphs[0] == graphs[1] > 1, graphs   # pieces of plain-tensor code between DTensor calls


# ============================================================================ context parallel
CP_MODES = {"ulysses": {}, "allgather": {"ulysses_degree": 1},
            "load_balance": {"ulysses_degree": 1, "load_balance": True},
            "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},
            "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True}}
# (graphs, graph breaks) of each compiled region, as docs/compile.md states: the ring's hops are
# traced as all-to-alls (compile_collectives.p2p_exchange); the load-balance head-tail swap (also
# zigzag's) has no functional form, so a region containing one breaks there and dynamo runs it
# eagerly (correct, not compiled)
CP_GRAPHS = {"ulysses": {"around": (1, 0), "inside": (1, 0)},
             "allgather": {"around": (1, 0), "inside": (1, 0)},
             "load_balance": {"around": (1, 0), "inside": (2, 1)},
             "ring": {"inside": (1, 0)}, "zigzag": {"inside": (2, 1)}}
HEADS, HEAD_DIM = 4, 8


def _attention():
    """Core attention on BSHD q, k, v (what ContextParallel wraps)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def forward(self, q, k, v):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
            return out.transpose(1, 2)
    return Attention()


def _attention_block(attention):
    """Projections around a core-attention module (the module compiled *around* a CP call)."""
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(DIM, 3 * HEADS * HEAD_DIM)
            self.out = nn.Linear(HEADS * HEAD_DIM, DIM)
            self.attention = attention

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD_DIM).unbind(2)
            return self.out(torch.relu(self.attention(q, k, v)).reshape(b, s, -1))
    torch.manual_seed(0)
    return Block()


def _cp_case(rank, world, modes):
    """Per mode: (a) ContextParallel around a compiled attention module, (b) a compiled block
    whose attention module is ContextParallel; both against the same CP modules run eagerly."""
    import copy

    from hyper_parallel import ContextParallel, init_device_mesh
    from hyper_parallel.platform.torch.compile_support import compile_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    results = {}
    for name in modes:
        mode = CP_MODES[name]
        ref = _attention_block(_attention())
        eager = [copy.deepcopy(ref) for _ in range(2)]    # one per comparison (each steps AdamW)
        for module in eager:
            ContextParallel(**mode).apply(module.attention, mesh)
        around = copy.deepcopy(ref)
        compile_module(around.attention, backend="aot_eager")
        ContextParallel(**mode).apply(around.attention, mesh)
        inside = copy.deepcopy(ref)
        ContextParallel(**mode).apply(inside.attention, mesh)
        compile_module(inside, backend="aot_eager")

        def make_inputs(step):
            return _inputs(step, world, rank)
        x = make_inputs(0)[0][0]
        _compare_steps(inside, eager[1], make_inputs, 2, f"{name}: compiled block with a CP attention")
        results[name] = {"inside": _explain(inside, x)}
        if mode.get("kv_exchange") == "ring":   # the ring follows q, k, v by identity: refused
            around(x)   # a signature's first call runs eagerly; the compiled one is refused
            with pytest.raises(ValueError, match="never called F.scaled_dot_product_attention"):
                around(x)
            continue
        _compare_steps(around, eager[0], make_inputs, 2, f"{name}: CP around a compiled attention")
        q = k = v = x.new_zeros(BATCH, SEQ // world, HEADS, HEAD_DIM)
        results[name]["around"] = _explain(around.attention, q, k, v)
    return results


def _check_cp(modes):
    results = run_dist(2, _cp_case, modes, timeout=900)
    assert results[0] == results[1]
    for name, res in results[0].items():
        assert res == CP_GRAPHS[name], (name, res)


def test_context_parallel_compiled():
    """Ulysses, load-balanced and ring CP: compiled attention inside CP and a compiled block around
    CP both equal eager; the graphs and breaks are the documented ones."""
    _check_cp(["ulysses", "load_balance", "ring"])


@pytest.mark.compile_full
def test_context_parallel_compiled_every_mode():
    _check_cp(list(CP_MODES))


# ============================================================================ fully_shard / data_parallel
def _stack(n=2):
    import torch
    import torch.nn as nn
    torch.manual_seed(0)
    return nn.Sequential(*[_block() for _ in range(n)])


def _sharded_case(rank, world):
    """torchtitan's pattern: each block compiled, fully_shard on each block then the root (its
    hooks stay outside the compiled graphs); and data_parallel around compiled blocks. Three
    AdamW steps against one process on the global batch (each rank its batch rows)."""
    import copy

    import torch
    from hyper_parallel import data_parallel, fully_shard, init_device_mesh
    from hyper_parallel.platform.torch.compile_support import compile_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ref = _stack()
    results = {}
    for name in ("fully_shard", "data_parallel"):
        single = copy.deepcopy(ref)
        model = copy.deepcopy(ref)
        for block in model:
            compile_module(block, backend="aot_eager")
            if name == "fully_shard":
                fully_shard(block, mesh)
        model = fully_shard(model, mesh) if name == "fully_shard" else data_parallel(model, mesh)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, single)]
        for step in range(3):
            (x,), w = _inputs(step)
            for opt in opts:
                opt.zero_grad()
            local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            (model(x[local]) * w[local]).sum().backward()
            (single(x) * w).sum().div(world).backward()   # each rank averages over its rows
            for (pname, p), q in zip(model.named_parameters(), single.parameters()):
                _close(p.grad, q.grad, f"{name} grad of {pname}, step {step}")
            for opt in opts:
                opt.step()
        with torch.no_grad():
            (x,), _ = _inputs(9)
            _close(model(x), single(x), f"{name} output after 3 steps")
        if name == "fully_shard":
            model[0].unshard()   # the explain call runs the block's forward outside the root's
        results[name] = _explain(model[0])   # the signature training used
        if name == "fully_shard":
            model[0].reshard()
    return results


@pytest.mark.compile_full
def test_fully_shard_and_data_parallel_with_compiled_blocks():
    results = run_dist(2, _sharded_case, timeout=600)
    assert results[0] == {"fully_shard": (1, 0), "data_parallel": (1, 0)}, results[0]


# ============================================================================ the example
@pytest.mark.compile_full
@pytest.mark.timeout(900)      # four spawned ranks compiling two layers each: minutes on a loaded machine
def test_example_compile_matches_one_process():
    """examples/train_llama_hf.py --compile under fully_shard x TP: every step's loss equals one
    process (--check). The example's mesh has a cp dim: its layers receive MaskSpec masks, which
    carry the forward's masks into the compiled graph (docs/compile.md)."""
    pytest.importorskip("transformers")
    from tests.test_fully_shard_examples import TINY, _assert_checked, _run
    _assert_checked(_run("train_llama_hf.py", "--cp", "1", "--tp", "2", "--dp-shard", "2", "--compile",
                         "aot_eager", *TINY, timeout=850))


# ============================================================================ expert parallel
def _expert_case(rank, world):
    """parallelize_model(ep=..., compile=...): a Mixtral with experts over the data ranks, every
    decoder layer compiled; two AdamW steps against one process on the global batch."""
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from hyper_parallel.platform.torch.compile_support import compiled_of
    from hyper_parallel.integrations.hf_fully_shard import decoder_layers
    from tests.test_expert_parallel import _check_step, _mean_over_ranks, _optimizers, ids, make

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model = parallelize_model(make("mixtral"), mesh, ep="dp_shard", compile={"backend": "aot_eager"})
    ref = make("mixtral")
    opt, ref_opt = _optimizers(model, ref)
    for step in range(2):
        out = model(input_ids=ids(rank, step), labels=ids(rank, step), use_cache=False)
        out.loss.backward()
        batch = torch.cat([ids(i, step) for i in range(world)])
        ref_out = ref(input_ids=batch, labels=batch)
        ref_out.loss.backward()
        torch.testing.assert_close(_mean_over_ranks(out.loss, mesh.get_group(0)), ref_out.loss.detach(),
                                   atol=1e-5, rtol=1e-5)
        _check_step(model, ref, opt, ref_opt, f"compiled mixtral ep={world}", out, ref_out)
    # the routing reads its counts on the host: a layer with expert-parallel MoE is compiled around
    # it (its attention one graph, traced at the second step), the MoE block eager
    return [(compiled_of(layer) is None,
             any(state["traced"] for *_, state in compiled_of(layer.self_attn).compiled.values()),
             compiled_of(layer.mlp) is None) for layer in decoder_layers(model)]


@pytest.mark.compile_full
def test_expert_parallel_compiled_layers():
    """Expert-parallel Mixtral with compile=...: equal to one process; in each layer the attention
    is compiled and the MoE block runs eagerly (documented: the dispatch reads routing counts on
    the host)."""
    pytest.importorskip("transformers")
    assert run_dist(2, _expert_case, timeout=900) == [[(True, True, True)] * 2] * 2
