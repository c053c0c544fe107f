def probe(rank, world_size):
    import warnings
    import numpy as np
    import mindspore as ms
    from mindspore import mint, ops
    from hyper_parallel import DTensor, Replicate, Shard, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    w = DTensor.from_local(ms.Tensor(np.ones((4, 3), np.float32)), mesh, [Shard(0)])
    ids = DTensor.from_local(ms.Tensor(np.array([[0, 5, 7]], np.int32)), mesh, [Replicate()])
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, fn in [("gather", lambda: ops.gather(w, ids, 0)), ("mint.embedding", lambda: mint.nn.functional.embedding(ids, w)),
                         ("nn.Embedding", None), ("cross_entropy", lambda: mint.nn.functional.cross_entropy(w, DTensor.from_local(ms.Tensor(np.array([0,1,2,0]*world_size, np.int32)), mesh, [Shard(0)]))),
                         ("rms_norm", lambda: ops.rms_norm(w, ms.Tensor(np.ones(3, np.float32)))),
                         ("add_", lambda: w.add_(1.0)), ("copy_", lambda: w.copy_(w))]:
            if fn is None:
                continue
            try:
                r = fn()
                out.append((name, "ok", str(type(r).__name__)))
            except Exception as e:
                out.append((name, "err", repr(e)[:300]))
    out.append([str(c.message)[:120] for c in caught])
    return out
