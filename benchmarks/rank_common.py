"""What the per-rank benchmarks (compile_step.py, fully_shard.py, moe.py) share: the interleaved
timing rounds, every rank's result gathered to rank 0 for the report, the closing barrier and the
process group's end, and the JSON file."""
import json
import statistics
import time


def interleaved_rounds(torch, names, step, rounds):
    """``rounds`` rounds; in each, every setup in ``names`` runs ``step(name)`` once after a
    barrier (setups interleaved, so a slow phase of a shared machine hits them alike). Returns
    ({name: [ms per round]}, {name: [step's return value per round]})."""
    times, values = {name: [] for name in names}, {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            torch.distributed.barrier()
            start = time.perf_counter()
            values[name].append(step(name))
            times[name].append((time.perf_counter() - start) * 1e3)
    return times, values


def medians(times):
    """{name: median} of {name: [values]}."""
    return {name: statistics.median(values) for name, values in times.items()}


def median_over_ranks(results, names=None, key="step_ms"):
    """{name: median over ranks of each rank's ``result[key][name]``}."""
    names = list(results[0][key]) if names is None else names
    return {name: statistics.median(r[key][name] for r in results) for name in names}


def finish(torch, args, result, report):
    """Every rank's ``result`` to rank 0, which calls ``report(args, results)``; then a barrier
    (no rank leaves while rank 0 reports) and the process group's end."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, result)
    if torch.distributed.get_rank() == 0:
        report(args, gathered)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def write_json(path, payload):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
