"""``python -m hyper_parallel.plan dry-run|search ...`` (see cli.py)."""
import sys

from hyper_parallel.plan.cli import main

sys.exit(main())
