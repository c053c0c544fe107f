"""The planner's vocabulary: context-parallel modes and long-sequence features, and what they mean
for ``parallelize_model`` (SPEC §6, §15)."""
from typing import Dict, Optional, Sequence

# mode name -> ContextParallel keyword arguments (docs/context_parallel.md)
CP_MODES: Dict[str, dict] = {
    "ulysses": {},                                                       # all-to-all heads (ds = cp)
    "allgather": {"ulysses_degree": 1},                                  # all-gather K/V
    "allgather_lb": {"ulysses_degree": 1, "load_balance": True},         # ... head-tail balanced
    "ring": {"ulysses_degree": 1, "kv_exchange": "ring"},                # K/V blocks rotate (P2P)
    "zigzag": {"ulysses_degree": 1, "kv_exchange": "ring", "load_balance": True},
}
# chunked_loss: projection + cross-entropy in tiles (no tokens x vocab logits); tiled_mlp: each MLP in
# sequence tiles under recompute; checkpoint: each decoder layer recomputed in backward
FEATURES = ("chunked_loss", "tiled_mlp", "checkpoint")


def cp_kwargs(mode: Optional[str]) -> dict:
    if mode is None:
        return {}
    if mode not in CP_MODES:
        raise ValueError(f"cp_mode {mode!r} is not a mode the planner knows; pass one of {sorted(CP_MODES)} "
                         f"(mode='auto' measures links, which a dry run cannot: the planner searches the "
                         f"modes)")
    return dict(CP_MODES[mode])


def check_features(features: Sequence[str], cp_mode: Optional[str], sizes: Dict[str, int]) -> None:
    if isinstance(features, str):   # iterating it would test its letters
        raise ValueError(f"features={features!r} must be a list of feature names, e.g. [{features!r}]; "
                         f"known: {list(FEATURES)}")
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"features {unknown} are unknown; pass some of {list(FEATURES)}")
    cp_kwargs(cp_mode)
    if cp_mode is not None and sizes.get("cp", 1) == 1:
        raise ValueError(f"cp_mode={cp_mode!r} given but the mesh has no cp dim larger than 1")
