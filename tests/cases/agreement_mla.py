"""MLA's attend path (core/context_parallel/mla/attend.py) when the CP ranks disagree (SPEC §19):
the kernel's settings (scale, is_causal, hyper_parallel.attention's window / softcap), load_balance
and attention_masks per rank. Every case is the first call of its settings, so every rank checks and
raises a ValueError naming the setting; a collective afterwards must work (the ranks are in step)."""
B, H, L, D = 1, 2, 4, 4


def _qkv(torch, rank, world, seed, length=L):
    """This rank's query block and the whole K/V; each case its own length (its first call)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, world * length, D, generator=g) for _ in range(3))
    return q[:, :, rank * length:(rank + 1) * length], k, v


def _call(torch, kw):
    import torch.nn.functional as F

    import hyper_parallel as hp

    def call(q, k, v):
        if "window" in kw or "softcap" in kw:
            return hp.attention(q, k, v, **kw)
        return F.scaled_dot_product_attention(q, k, v, **kw)
    return call


def _in_step(torch, mesh, what):
    from hyper_parallel import DTensor, Shard
    x = torch.arange(2.0 * mesh.size()).reshape(mesh.size(), 2)
    me = mesh.get_local_rank(0)
    assert torch.equal(DTensor.from_local(x[me:me + 1], mesh, [Shard(0)]).full_tensor(), x), what


CASES = [  # (name, keyword arguments of most ranks' kernel, of the odd rank's, attend_gathered options)
    ("scale", {"is_causal": True, "scale": 0.5}, {"is_causal": True, "scale": 0.25}, {}, "scale (rank"),
    ("is_causal", {"is_causal": True}, {"is_causal": False}, {}, "is_causal (rank"),
    ("window", {"is_causal": True, "window": 2}, {"is_causal": True, "window": 3}, {}, "window (rank"),
    ("softcap", {"is_causal": True, "softcap": 20.0}, {"is_causal": True, "softcap": 30.0}, {},
     "softcap (rank"),
    ("load_balance", {"is_causal": True}, {"is_causal": True}, {"load_balance": True}, "load_balance (rank"),
    ("masks", {"is_causal": True}, {"is_causal": True}, {"masks": "documents"}, "attention_masks"),
]


def disagreements(rank, world_size):
    import torch

    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.masks.attention_masks import attention_masks
    from hyper_parallel.core.context_parallel.mla import attend_gathered
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=20)
    odd = rank == world_size - 1
    for i, (name, kw, odd_kw, options, fragment) in enumerate(CASES):
        length = 2 * (i + 3)
        q, k, v = _qkv(torch, rank, world_size, i, length)
        options = dict(options) if odd else {}
        ids = torch.zeros(B, world_size * length, dtype=torch.long)
        ids[:, length:] = 1

        def run():
            if options.pop("masks", None):
                with attention_masks(document_ids=ids) as masks:
                    return attend_gathered(q, k, v, mesh, _call(torch, odd_kw if odd else kw), masks=masks)
            return attend_gathered(q, k, v, mesh, _call(torch, odd_kw if odd else kw), **options)
        try:
            run()
        except ValueError as exc:
            assert fragment in str(exc) and "MLA latent all-gather attention" in str(exc), (name, str(exc))
        else:
            raise AssertionError(f"{name}: no ValueError")
        _in_step(torch, mesh, name)
    return True


def gap(rank, world_size):
    """Steady state with scale 0.5 after 0.25 was verified too; the odd rank alone goes back to 0.25."""
    import torch

    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.mla import attend_gathered
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=5)
    q, k, v = _qkv(torch, rank, world_size, 99)
    for scale in (0.5, 0.25, 0.5, 0.5):
        attend_gathered(q, k, v, mesh, _call(torch, {"is_causal": True, "scale": scale}))
    odd = rank == world_size - 1
    try:
        attend_gathered(q, k, v, mesh, _call(torch, {"is_causal": True, "scale": 0.25 if odd else 0.5}))
        _in_step(torch, mesh, "after the gap")   # the forward has no collective of its own: the next one
    except Exception as exc:  # noqa: BLE001 - the peers' collective times out, the odd rank names the check
        text = str(exc)
        want = ["the agreement check", "scale (rank"] if odd else ["timed out"]
        assert all(w in text for w in want), text
        return True
    raise AssertionError("no error")
