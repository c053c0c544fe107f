"""The agreement check's schedule after steady state (SPEC §19, issue 36): a call site that continues
its sequence of settings exchanges nothing; a rank that changes a setting ALONE, even to a key every
rank verified earlier, must not go on silently: it checks again, on the agreement companion group,
and raises a ValueError naming the feature and the setting once the mesh's timeout passes; its
peers' next collective times out (bounded). Meshes carry a 5 s timeout; a case that leaves the
ranks out of step is the last of its function (the test kills the pool afterwards)."""
import numpy as np

from tests.frameworks import expect_error, inp, t

GAP_TIMEOUT = 5


def _raises_any(fn, *fragments):
    """Any exception whose text holds every fragment (a collective's timeout is not a ValueError)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type differs per framework
        text = f"{type(exc).__name__}: {exc}"
        missing = [f for f in fragments if f not in text]
        assert not missing, f"error without {missing}: {text}"
        return text
    raise AssertionError(f"no error (expected one naming {fragments})")


def steady_state_is_free(rank, world_size):
    """CommDebugMode counts: a repeated key, and a site alternating between two keys once learnt,
    exchange nothing; a change every rank makes together checks once."""
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.agreement import check_agreement
    from hyper_parallel.core.comm_mode import CommDebugMode
    mesh = init_device_mesh("cpu", (world_size,), timeout=20)

    def call(window):
        check_agreement(mesh, "Steady", {"window": window}, signature="site")
    with CommDebugMode() as learn:
        for window in (4, 4, None, 4, None):   # first call, the repeat is assumed, 4->None, None->4 learnt
            call(window)
    with CommDebugMode() as steady:
        for window in (4, None) * 4 + (None, None):
            call(window)
    assert learn.get_total_counts() == 3, learn.get_comm_counts()
    # the (None, None) repeat is a new successor of None: one check, taken by every rank alike
    assert steady.get_total_counts() == 1, steady.get_comm_counts()
    return True


def generic_gap(rank, world_size):
    """check_agreement itself: every rank verified window 4 and window None; later the odd rank
    alone goes back to None. It raises naming the setting; the peers' next collective times out."""
    from hyper_parallel import DTensor, Shard, init_device_mesh
    from hyper_parallel.core.agreement import check_agreement
    mesh = init_device_mesh("cpu", (world_size,), timeout=GAP_TIMEOUT)
    odd = rank == world_size - 1
    for window in (4, None, 4, 4):
        check_agreement(mesh, "Gap", {"window": window}, signature="site")
    if odd:
        expect_error(ValueError, lambda: check_agreement(mesh, "Gap", {"window": None}, signature="site"),
                     "Gap: the agreement check", "was not joined", "window (rank", "now has None")
        return True
    check_agreement(mesh, "Gap", {"window": 4}, signature="site")   # continues its sequence: no exchange
    x = inp("gap-step", 0, (2 * world_size, 3))
    _raises_any(lambda: DTensor.from_local(t(x[2 * rank:2 * rank + 2]), mesh, [Shard(0)]).full_tensor(),
                "timed out")
    return True


def chunked_loss_gap(rank, world_size):
    """A vocab-parallel chunked_cross_entropy: reduction 'mean' and 'sum' both verified, then the odd
    rank alone switches back to 'mean' (was a silently different loss)."""
    from hyper_parallel import Shard, chunked_cross_entropy, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",), timeout=GAP_TIMEOUT)
    odd = rank == world_size - 1
    V, E, N = 2 * world_size, 3, 4
    weight = distribute_tensor(t(inp("gap-ce/w", 0, (V, E))), mesh, [Shard(0)])
    hidden = t(inp("gap-ce/h", 0, (N, E)))
    labels = t(np.arange(N, dtype=np.int64) % V)
    for reduction in ("mean", "sum", "sum"):
        chunked_cross_entropy(hidden, weight, labels, reduction=reduction)
    if odd:
        expect_error(ValueError, lambda: chunked_cross_entropy(hidden, weight, labels, reduction="mean"),
                     "chunked_cross_entropy: the agreement check", "reduction (rank", "'mean'")
    else:
        _raises_any(lambda: chunked_cross_entropy(hidden, weight, labels, reduction="sum"), "timed out")
    return True


def cp_window_gap(rank, world_size):
    """hyper_parallel.attention under ContextParallel: window 3 and no window both verified, then the
    odd rank alone drops the window (was a silently different attention on that rank)."""
    import torch

    import hyper_parallel as hp
    from hyper_parallel import ContextParallel, init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=GAP_TIMEOUT)
    odd = rank == world_size - 1

    class Attention(torch.nn.Module):
        window = 3

        def forward(self, q, k, v):
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            return hp.attention(q, k, v, is_causal=True, window=self.window).transpose(1, 2)
    cell = Attention()
    ContextParallel().apply(cell, mesh)
    S = 4 * world_size
    g = torch.Generator().manual_seed(7)
    whole = [torch.randn(1, S, 2, 4, generator=g) for _ in range(3)]
    q, k, v = (x[:, rank * 4:(rank + 1) * 4] for x in whole)
    for window in (3, None, 3, 3):
        cell.window = window
        cell(q, k, v)
    cell.window = None if odd else 3
    if odd:
        expect_error(ValueError, lambda: cell(q, k, v), "the attention call: the agreement check",
                     "window (rank", "now has None")
    else:
        _raises_any(lambda: cell(q, k, v), "timed out")
    return True


def linear_attention_gap(rank, world_size):
    """The delta rule under CP: scale 0.5 and the default both verified, then the odd rank alone goes
    back to the default (was silent: its signature was None, so the verified key let it pass)."""
    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.context_parallel.linear_attention import context_parallel_delta_rule
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",), timeout=GAP_TIMEOUT)
    odd = rank == world_size - 1
    T, H, D = 2, 2, 4
    q, k, v = (t(inp(f"gap-la/{n}", rank, (1, T, H, D))) for n in "qkv")
    g = t(-np.abs(inp("gap-la/g", rank, (1, T, H))))
    beta = t(np.full((1, T, H), 0.5, np.float32))
    for scale in (0.5, None, 0.5, 0.5):
        context_parallel_delta_rule(q, k, v, g, beta, mesh, scale=scale)
    if odd:
        expect_error(ValueError, lambda: context_parallel_delta_rule(q, k, v, g, beta, mesh, scale=None),
                     "linear attention (delta rule): the agreement check", "scale (rank", "now has None")
    else:
        _raises_any(lambda: context_parallel_delta_rule(q, k, v, g, beta, mesh, scale=0.5), "timed out")
    return True


def fully_shard_extra_call(rank, world_size):
    """After two steps alike, the odd rank runs block 0 twice in the root's forward: it checks the
    unit's call alone and raises naming the unit and the call count; its peers time out (bounded)."""
    from hyper_parallel import init_device_mesh
    from tests import fully_shard_models as fm

    class RepeatNet(fm.Net):
        repeat_first = False

        def forward(self, x):
            h = self.blocks[0](self.inp(x))
            if self.repeat_first:
                h = self.blocks[0](h)
            return self.head(self.blocks[1](h))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",), timeout=GAP_TIMEOUT)
    model = fm.shard_net(RepeatNet(), mesh)
    for step in range(2):
        fm.loss_fn(model(fm.batch(step, rank))).backward()
    model.repeat_first = rank == world_size - 1
    if model.repeat_first:
        expect_error(ValueError, lambda: model(fm.batch(2, rank)),
                     "fully_shard unit call: the agreement check", "was not joined",
                     "call of the unit in this forward (rank", "now has 2", "unit='blocks.0'",
                     "call every fully_shard unit the same number of times")
    else:   # the forward's gathers were issued alike (prefetched); the backward's reduction waits
        _raises_any(lambda: fm.loss_fn(model(fm.batch(2, rank))).backward(), "timed out")
    return True
