"""chunked_cross_entropy on any framework (imported by torch AND MindSpore workers: no torch, no
pytest): values and the gradients of hidden and weight against numpy's closed form
(softmax − one-hot), for every reduction and several tile sizes."""
import numpy as np

from tests.frameworks import close, grad_of, inp, t

VOCAB, HIDDEN, TOKENS = 11, 4, 9


def _reference(h, w, y, reduction, upstream):
    """(loss, d hidden, d weight) of sum(upstream * loss) for "none", else of the reduced loss."""
    logits = h.reshape(-1, HIDDEN).astype(np.float64) @ w.T.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    soft = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
    flat = y.reshape(-1)
    valid = flat != -100
    rows = np.arange(len(flat))
    losses = (np.log(np.exp(shifted).sum(-1)) - shifted[rows, np.clip(flat, 0, VOCAB - 1)]) * valid
    one_hot = np.zeros_like(soft)
    one_hot[rows, np.clip(flat, 0, VOCAB - 1)] = 1
    scale = {"sum": valid * 1.0, "mean": valid / valid.sum(), "none": valid * upstream.reshape(-1)}[reduction]
    g = (soft - one_hot) * scale[:, None]
    value = {"sum": losses.sum(), "mean": losses.sum() / valid.sum(),
             "none": losses.reshape(y.shape)}[reduction]
    return value, (g @ w).reshape(h.shape), g.T @ h.reshape(-1, HIDDEN)


def matches_closed_form(rank, world_size):
    from hyper_parallel import chunked_cross_entropy
    h, w = inp("ce_h", 0, (2, TOKENS, HIDDEN)), inp("ce_w", 0, (VOCAB, HIDDEN))
    y = (np.abs(inp("ce_y", 0, (2, TOKENS))) * 7).astype(np.int64) % VOCAB
    y[0, 0] = y[1, 3] = -100
    upstream = inp("ce_up", 0, (2, TOKENS))
    checked = 0
    for reduction in ("sum", "mean", "none"):
        for chunk in (1, 4, 100):
            def loss(a, b):
                out = chunked_cross_entropy(a, b, t(y), chunk_size=chunk, reduction=reduction)
                return (out * t(upstream)).sum() if reduction == "none" else out
            value, want_h, want_w = _reference(h, w, y, reduction, upstream)
            close(chunked_cross_entropy(t(h), t(w), t(y), chunk_size=chunk, reduction=reduction), value,
                  f"{reduction} chunk {chunk} value", rtol=1e-5, atol=1e-5)
            got_h, got_w = grad_of(loss, t(h), t(w))
            close(got_h, want_h, f"{reduction} chunk {chunk} d hidden", rtol=1e-5, atol=1e-5)
            close(got_w, want_w, f"{reduction} chunk {chunk} d weight", rtol=1e-5, atol=1e-5)
            checked += 1
    return checked
