"""MindSpore: a DTensor's empty placeholder is never read silently (ms.Parameter(dt), pickling,
copy.copy, dt.data, storage, ms.save_checkpoint, numpy conversions): exact or a ValueError / TypeError
naming dt.to_local() / dt.full_tensor()."""
from tests.cases import ms_placeholder_reads as cases
from tests.harness.frameworks import run_on, require_mindspore


def test_placeholder_is_never_read_silently():
    require_mindspore()
    assert run_on("mindspore", 2, cases.placeholder_reads, timeout=120) == [True, True]
