"""pytest configuration: stop the multi-process worker pools when the session ends, and print the
op sweep's table (tests/test_op_sweep.py) when it ran."""
import sys

from tests.harness import shutdown_pools


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    sweep = sys.modules.get("tests.test_op_sweep")
    text = sweep.format_tables() if sweep is not None else ""
    if text:
        terminalreporter.section("op sweep: rule / fallback / error per op")
        terminalreporter.write_line(text)
