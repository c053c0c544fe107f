"""ContextParallel(overlap=True) on any framework: the neutral CP grid (tests/cases/context_parallel.py)
run under ``observe_pipeline``, returning which pipeline events each chunk produced."""


def overlapped_grid(rank, world_size, plan, S=16, H=8):
    """``cp_grid`` of ``plan`` (style kwargs with overlap=True); returns (checks done, sorted
    [(stage, chunk, event)] seen)."""
    from hyper_parallel.core.context_parallel.overlap import observe_pipeline
    from tests.cases.context_parallel import cp_grid
    seen = set()
    with observe_pipeline(lambda stage, chunk, event: seen.add((stage, chunk, event))):
        done = cp_grid(rank, world_size, plan, S, H)
    return done, sorted(seen)
