"""ContextParallel(overlap=True) on any framework: the neutral CP grid (tests/cases/context_parallel.py)
run under ``observe_pipeline``, returning which pipeline events each chunk produced."""


def overlapped_grid(rank, world_size, plan, S=16, H=8):
    """``cp_grid`` of ``plan`` (style kwargs with overlap=True); returns (checks done,
    [(stage, chunk, event)] in the order they happened)."""
    from hyper_parallel.core.context_parallel.overlap.pipeline import observe_pipeline
    from tests.cases.context_parallel import cp_grid
    seen = []
    with observe_pipeline(lambda stage, chunk, event: seen.append((stage, chunk, event))):
        done = cp_grid(rank, world_size, plan, S, H)
    return done, seen


def split_grid(rank, world_size, plan, H=8):
    """Each (style kwargs, points) of ``plan`` called as ``start_attention(...).finish()`` on the
    neutral CP check (vs one device, forward and dq/dk/dv); returns the checks done."""
    from tests.cases.context_parallel import _cp_mesh, check
    mesh = _cp_mesh(world_size)
    return [check(rank, world_size, mesh, style, *point, H=H, split=True) for style, points in plan
            for point in points]
