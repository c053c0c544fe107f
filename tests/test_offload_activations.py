"""offload_activations: every tensor autograd saves inside goes through the hooks (to host and back)
and the gradients equal those without the context (on this CPU-only machine the host copy is a
copy in host memory; pinned device-to-host copies need an accelerator)."""
import pytest
import torch

from hyper_parallel import offload_activations

pytest.importorskip("transformers")


def _grads(offload, backward_inside=True):
    from tests.hf_zoo import tiny
    model = tiny("llama")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    stats = None
    if offload:
        with offload_activations() as stats:
            loss = model(input_ids=ids, labels=ids).loss
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, stats


@pytest.mark.parametrize("backward_inside", [True, False])
def test_offloaded_gradients_are_exact(backward_inside):
    want, _ = _grads(False)
    got, stats = _grads(True, backward_inside)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    assert stats.offloaded > 20 and stats.offloaded_bytes > 0, stats
    assert stats.restored == stats.offloaded, stats          # every offloaded tensor came back once
    assert stats.kept > 0, stats                              # parameters stay where they are


def test_saved_tensors_are_host_copies():
    x = torch.randn(8, 8, requires_grad=True)
    with offload_activations() as stats:
        y = x.exp()                    # exp saves its output
    assert stats.offloaded == 1
    y.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().exp())


def test_offload_with_tiled_mlp_is_exact():
    """The checkpointed tiles nest their own saved-tensor hooks inside the offloading ones."""
    from hyper_parallel import tiled_mlp
    from tests.hf_zoo import tiny
    want, _ = _grads(False)
    model = tiny("llama")
    for layer in model.model.layers:
        tiled_mlp(layer.mlp, 4)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with offload_activations() as stats:
        model(input_ids=ids, labels=ids).loss.backward()
    assert stats.offloaded > 0 and stats.restored == stats.offloaded, stats
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-6, atol=1e-6)
