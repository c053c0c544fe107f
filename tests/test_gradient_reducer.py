"""The one gradient reducer's building blocks (core/data_parallel/reducer.py), in one process: the
bucket plan every rank shares, and the platform's flat-buffer contract (sizes, pack, unpack) that
data_parallel and fully_shard reduce through on both platforms. The collectives themselves run in
tests/test_data_parallel.py, test_fully_shard*.py and the MindSpore training tests."""


def test_buckets_keep_one_dtype_each_and_respect_the_cap():
    from hyper_parallel.core.data_parallel.reducer import plan_buckets
    entries = [(0, "f32", 40), (1, "f32", 40), (2, "bf16", 10), (3, "f32", 40), (4, "f32", 200),
               (5, "bf16", 10)]
    # cap 100: two float32 gradients fit, the third opens a bucket; one over the cap travels alone
    assert plan_buckets(entries, 100) == [[0, 1], [2, 5], [3], [4]]
    assert plan_buckets([], 100) == []


def test_pack_and_unpack_round_trip_with_the_flags_behind():
    import torch
    from hyper_parallel import get_platform
    platform = get_platform()
    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([7.0, 8.0])
    assert platform.tensor_nbytes(a) == 24 and platform.tensor_nbytes(b.to(torch.bfloat16)) == 4
    flat = platform.pack_flat([a, b], [1.0, 0.0])
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0, 1.0, 0.0]
    back = platform.unpack_flat(flat, [(2, 3), (2,)])
    assert torch.equal(back[0], a) and torch.equal(back[1], b)
