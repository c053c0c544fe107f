"""MindSpore tests: the harness (``harness.py``, runs in the pytest process) and the cases
(``cases_*.py``, run in MindSpore worker processes; importable without torch or pytest)."""
