"""Run a code block of the docs on a pooled worker of either framework (tests/test_docs_snippets.py).
Imported by torch AND MindSpore workers: no torch, no pytest here."""
import os


def run(rank, world_size, code, where, workdir):
    """Execute ``code`` as a script (``__name__ == "__main__"``) in ``workdir``, which every rank
    shares (files a block writes, e.g. a checkpoint, land there and not in the checkout)."""
    here = os.getcwd()
    os.chdir(workdir)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(here)
    return rank
