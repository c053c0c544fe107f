"""Tensor parallelism on any framework: a ColwiseParallel -> RowwiseParallel MLP vs the same MLP in
one process, forward (one all-reduce), the gradients of the input and of every parameter, and the
forward after an SGD step on the parallel parameters.
"""
import numpy as np

from tests.frameworks import close, current, inp, t

E, F, TOKENS = 8, 12, (2, 3)


def colwise_rowwise(rank, world_size, kind):
    """``kind``: the framework's Linear flavour (see the adapter's ``mlp``). Returns the parameter
    names of the parallel MLP."""
    from hyper_parallel import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    from hyper_parallel.core.comm_mode import CommDebugMode
    fw = current()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    ref = fw.mlp(kind, E, F)
    arrays = {name: inp(f"tp{name}", 0, shape) for name, shape in fw.parameter_shapes(ref).items()}
    fw.set_parameters(ref, arrays)
    x = inp("tpx", 0, TOKENS + (E,))
    w_out = inp("tpw", 0, TOKENS + (E,))

    def loss_of(module):
        return lambda xx: (module(xx) * t(w_out)).sum()
    ref_out = fw.numpy(ref(t(x)))
    ref_dx, ref_grads = fw.grads_then_sgd(ref, loss_of(ref), t(x), lr=0.1)

    mlp = fw.mlp(kind, E, F)
    fw.set_parameters(mlp, arrays)
    parallelize_module(mlp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    with CommDebugMode() as comm:
        out = mlp(t(x))
    assert fw.is_plain_tensor(out), type(out)
    close(out, ref_out, f"{kind} MLP forward")
    # from_local's one-time "shape_check" (first call of a signature in the process) aside
    data = {op: n for op, n in comm.get_comm_counts().items() if op != "shape_check"}
    assert data == {"all_reduce": 1}, comm.get_comm_counts()   # Megatron's g
    dx, grads = fw.grads_then_sgd(mlp, loss_of(mlp), t(x), lr=0.1)
    close(dx, ref_dx, f"{kind} MLP d input")
    n, r = world_size, rank
    expected = {  # Colwise: weight rows (out features) and bias split; Rowwise: weight columns split
        "w1.weight": np.split(ref_grads["w1.weight"], n, 0)[r],
        "w1.bias": np.split(ref_grads["w1.bias"], n, 0)[r],
        "w2.weight": np.split(ref_grads["w2.weight"], n, 1)[r], "w2.bias": ref_grads["w2.bias"]}
    assert sorted(grads) == sorted(expected), sorted(grads)
    for name, g in grads.items():
        close(g, expected[name], f"{kind} MLP d {name}")
    # both took one SGD step: the next forward sees the new (sharded) weights
    close(mlp(t(x)), fw.numpy(ref(t(x))), f"{kind} MLP forward after an SGD step")
    return sorted(grads)



def embedding_styles(rank, world_size):
    """RowwiseParallel (vocab-parallel: masked lookup, one all-reduce) and ColwiseParallel
    (embedding dim split, output Shard(-1) gathered here with output_layouts=Replicate()) on the
    framework's Embedding module: forward, the table's gradient, the forward after an SGD step."""
    from hyper_parallel import ColwiseParallel, Replicate, RowwiseParallel, init_device_mesh, parallelize_module
    fw = current()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    vocab, dim = 4 * world_size, 8
    ids = t(np.random.RandomState(5).randint(0, vocab, (2, 5)).astype(np.int32))
    w_out = inp("embout", 0, (2, 5, dim))
    done = []
    for style, table_split in ((RowwiseParallel(), 0), (ColwiseParallel(output_layouts=Replicate()), 1)):
        ref = fw.embedding_module(vocab, dim)
        (name, shape), = fw.parameter_shapes(ref).items()
        table = inp("embtable", 0, shape)
        fw.set_parameters(ref, {name: table})
        emb = fw.embedding_module(vocab, dim)
        fw.set_parameters(emb, {name: table})
        parallelize_module(emb, mesh, style)
        what = f"{type(style).__name__} embedding"
        close(emb(ids), fw.numpy(ref(ids)), "forward " + what)
        _, ref_grads = fw.grads_then_sgd(ref, lambda x: (ref(x) * t(w_out)).sum(), ids, lr=0.5, input_grad=False)
        _, grads = fw.grads_then_sgd(emb, lambda x: (emb(x) * t(w_out)).sum(), ids, lr=0.5, input_grad=False)
        close(grads[name], np.split(ref_grads[name], world_size, table_split)[rank], "table gradient " + what)
        close(emb(ids), fw.numpy(ref(ids)), "forward after an SGD step " + what)
        done.append(what)
    return done
