"""pytest configuration: stop the multi-process worker pools when the session ends."""
from tests.harness import shutdown_pools


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
