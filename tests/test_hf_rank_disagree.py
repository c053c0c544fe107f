"""parallelize_model when the CP ranks are called with inputs that disagree (one rank 7 tokens, another
batch size, one rank's inputs refused): a ValueError on every rank before the position / mask
all-gathers whose sizes depend on them — never a gloo abort on one rank and a hang on the others."""
import pytest

from tests.harness import run_dist

pytest.importorskip("transformers")


def _disagree(rank, world_size):
    import torch
    from hyper_parallel import init_device_mesh
    from hyper_parallel.integrations.transformers import parallelize_model
    from tests.hf_zoo import VOCAB, tiny

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = parallelize_model(tiny("llama"), mesh, ulysses_degree=1)
    ids = torch.randint(0, VOCAB, (2, 8))
    cases = {
        "different inputs": dict(input_ids=ids[:, :7] if rank == 1 else ids),
        "different inputs ": dict(input_ids=ids[:1] if rank == 1 else ids),
        "refused their inputs": dict(input_ids=ids, position_ids=torch.arange(5)[None] if rank == 1 else None),
        "different inputs  ": dict(input_ids=ids, attention_mask=torch.ones(2, 8) if rank == 0 else None),
    }
    for match, kwargs in cases.items():
        expected = "position_ids of shape" if rank == 1 and "refused" in match else match.strip()
        with pytest.raises(ValueError, match=expected):
            model(**kwargs)
    loss = model(input_ids=ids).logits.sum()   # the model still works after the refused calls
    loss.backward()
    return True


def test_ranks_with_disagreeing_inputs_all_raise():
    assert run_dist(2, _disagree, timeout=60) == [True] * 2
