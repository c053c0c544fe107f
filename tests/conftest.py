"""pytest configuration: opt-in markers (``*_full``), stop the multi-process worker pools when the
session ends, and print the op sweep's table (tests/test_op_sweep.py) when it ran."""
import os
import sys

import pytest

# ContextParallel checks ranks against each other on a new input signature only (the steady state
# sends nothing extra). The worker pools outlive a test, so a later test's mismatched shapes could
# meet a signature an earlier test verified: the suite runs in debug mode, which checks every call;
# tests/test_cp_steady_state.py covers the default.
os.environ.setdefault("HP_CP_DEBUG", "1")

from tests.harness import shutdown_pools


def _opt_in_markers(config):
    """Markers named ``*_full`` (the whole op sweep, the whole Hugging Face sweep, ...) are exhaustive
    runs: registered in setup.cfg, skipped unless asked for by name in -m."""
    names = [line.split(":")[0].strip() for line in config.getini("markers")]
    return [name for name in names if name.endswith("_full")]


def pytest_collection_modifyitems(config, items):
    """An opt-in marker runs only when -m names it; any other -m, or none, leaves its tests out."""
    chosen = config.getoption("-m") or ""
    for marker in _opt_in_markers(config):
        if marker in chosen:
            continue
        skip = pytest.mark.skip(reason=f"opt-in: pytest -m {marker}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    sweep = sys.modules.get("tests.test_op_sweep")
    text = sweep.format_tables() if sweep is not None else ""
    if text:
        terminalreporter.section("op sweep: rule / fallback / error per op")
        terminalreporter.write_line(text)
