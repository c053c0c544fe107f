"""The MindSpore platform (HP_PLATFORM=mindspore) in real MindSpore worker processes: selection and
types, Cell hooks, module checks, tensor/device helpers, importing without a launcher. (Process
groups, custom autograd functions and the attention kernels are tested on both platforms in
tests/test_platform.py.) See tests/mindspore/harness.py for how the workers run."""
import os
import subprocess

import pytest

from tests.mindspore import cases_platform as cases
from tests.mindspore.harness import REPO, mindspore_python, require_mindspore, run_ms


pytestmark = pytest.mark.mindspore


@pytest.fixture(autouse=True)
def _needs_mindspore():
    require_mindspore()


def test_selection_and_types():
    assert run_ms(2, cases.selection) == [True, True]


def test_cell_hooks_and_module_checks():
    assert run_ms(2, cases.cell_hooks_and_modules) == [True, True]


def test_tensor_and_device_helpers():
    caps = run_ms(2, cases.tensor_helpers)[0]
    assert caps["backend"] == "mccl"


def test_import_without_launcher_and_core_stays_framework_free():
    """HP_PLATFORM=mindspore in a single process: the platform is chosen, core imports no
    framework itself, and init_process_group without launcher variables says what is missing."""
    code = (
        "import sys\n"
        "from hyper_parallel.platform import get_platform\n"
        "p = get_platform(); assert p.name == 'mindspore', p.name\n"
        "import hyper_parallel.core.dtensor, hyper_parallel.core.context_parallel\n"
        "import hyper_parallel.core.tensor_parallel\n"
        "assert 'torch' not in sys.modules, 'core imported torch'\n"
        "assert p.get_world_size() == 1 and p.get_rank() == 0\n"
        "try:\n"
        "    p.init_process_group()\n"
        "except RuntimeError as e:\n"
        "    assert 'MS_ROLE' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('init without a launcher did not raise')\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MS_")}
    env.update(HP_PLATFORM="mindspore", PYTHONPATH=REPO, GLOG_v="3")
    done = subprocess.run([mindspore_python(), "-c", code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
