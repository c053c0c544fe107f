"""The issue's two memory goals, measured in one process (``python -m benchmarks.max_seq`` prints them).

* loss: one forward + backward of the cross-entropy of ``tokens`` hidden states against a
  ``vocab`` × hidden output projection, plain (``F.cross_entropy(h @ w.T)``) vs
  ``chunked_cross_entropy`` — goal: chunked ≤ 0.25 × plain at 16k tokens and vocab 32k;
* MLP: one forward + backward of a Llama MLP on ``tokens`` tokens, plain vs ``tiled_mlp`` — goal ≤ 0.5×.

Peak memory is the platform's ``track_peak_memory`` over the step (on CPU: the bytes of every tensor
storage created inside and still alive; on an accelerator: the allocator's peak above its level
before), so the inputs and weights, made before, are not counted; gradients are.
"""
from hyper_parallel import chunked_cross_entropy, get_platform, tiled_mlp


def _peak(step):
    platform = get_platform()
    with platform.track_peak_memory() as memory:
        step()
    return memory.peak_bytes


def loss_peaks(tokens, vocab, hidden, chunk, device="cpu"):
    """(plain peak bytes, chunked peak bytes) of one loss forward + backward."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g).to(device)

    def plain():
        F.cross_entropy(h @ w.T, y, reduction="sum").backward()

    def chunked():
        chunked_cross_entropy(h, w, y, chunk_size=chunk, reduction="sum").backward()
    peaks = []
    for step in (plain, chunked):
        h.grad = w.grad = None
        peaks.append(_peak(step))
    return tuple(peaks)


def mlp_peaks(tokens, hidden, intermediate, chunks, device="cpu"):
    """(plain peak bytes, tiled peak bytes) of one Llama-MLP forward + backward."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=1)
    x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    peaks = []
    for tiles in (None, chunks):
        torch.manual_seed(0)
        mlp = LlamaMLP(config).to(device)
        if tiles:
            tiled_mlp(mlp, tiles)
        x.grad = None
        peaks.append(_peak(lambda: mlp(x).sum().backward()))
    return tuple(peaks)


def measure(args):
    """The goal rows: dicts with name, sizes, plain and tiled peaks, ratio, goal, met."""
    loss = loss_peaks(args.goal_tokens, args.goal_vocab, args.goal_hidden, args.goal_chunk, args.device)
    mlp = mlp_peaks(args.goal_tokens, args.goal_hidden, args.goal_intermediate, args.mlp_chunks, args.device)
    rows = []
    for name, sizes, (plain, tiled), goal in (
            ("loss", f"{args.goal_tokens} tokens, vocab {args.goal_vocab}, hidden {args.goal_hidden}, "
                     f"chunk {args.goal_chunk}", loss, 0.25),
            ("mlp", f"{args.goal_tokens} tokens, hidden {args.goal_hidden}, intermediate "
                    f"{args.goal_intermediate}, {args.mlp_chunks} tiles", mlp, 0.5)):
        ratio = tiled / plain if plain else float("nan")
        rows.append(dict(name=name, sizes=sizes, plain_bytes=plain, tiled_bytes=tiled, ratio=ratio, goal=goal,
                         met=ratio <= goal))
    return rows


def format_rows(rows):
    lines = [f"{'goal':6s} {'plain MiB':>10s} {'tiled MiB':>10s} {'ratio':>7s} {'target':>7s}  sizes"]
    for r in rows:
        lines.append(f"{r['name']:6s} {r['plain_bytes'] / 2**20:10.1f} {r['tiled_bytes'] / 2**20:10.1f} "
                     f"{r['ratio']:7.3f} {'<= ' + str(r['goal']):>7s}  {r['sizes']}"
                     f"{'' if r['met'] else '  (NOT met)'}")
    return "\n".join(lines)
