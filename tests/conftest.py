"""pytest configuration: stop the multi-process worker pools when the session ends, and print the
op sweep's table (tests/test_op_sweep.py) when it ran."""
import os
import sys

import pytest

# ContextParallel checks ranks against each other on a new input signature only (the steady state
# sends nothing extra). The worker pools outlive a test, so a later test's mismatched shapes could
# meet a signature an earlier test verified: the suite runs in debug mode, which checks every call;
# tests/test_cp_steady_state.py covers the default.
os.environ.setdefault("HP_CP_DEBUG", "1")

from tests.harness import shutdown_pools


def pytest_collection_modifyitems(config, items):
    """The full op sweep runs only when asked for by name (-m op_sweep_full); any other -m, or none,
    leaves it out."""
    if "op_sweep_full" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the full op sweep is opt-in: pytest -m op_sweep_full")
    for item in items:
        if "op_sweep_full" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    sweep = sys.modules.get("tests.test_op_sweep")
    text = sweep.format_tables() if sweep is not None else ""
    if text:
        terminalreporter.section("op sweep: rule / fallback / error per op")
        terminalreporter.write_line(text)
