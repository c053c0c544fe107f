#!/usr/bin/env bash
# Create (or reuse) the MindSpore environment the MindSpore tests run their workers in, and print
# its interpreter. MindSpore's communication needs numpy<2, while the main test environment keeps
# torch with numpy 2, so MindSpore gets a venv of its own (.venv-ms by default). The pytest process
# stays in the torch environment and starts MindSpore workers with this interpreter
# (tests/mindspore/harness.py finds .venv-ms, or HP_MINDSPORE_PYTHON).
#
#   bash .ci/mindspore_env.sh                 # -> /path/to/repo/.venv-ms/bin/python
#   HP_MS_VENV=/tmp/msenv bash .ci/mindspore_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HP_MS_VENV:-.venv-ms}"
PYTHON="${PYTHON:-python3}"
MINDSPORE_SPEC="${HP_MINDSPORE_SPEC:-mindspore==2.10.0}"

ready() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import numpy, mindspore
assert int(numpy.__version__.split(".")[0]) < 2
PY
}

if ! ready; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # the CPU wheel is ~800 MB; numpy<2 is required by MindSpore's communication paths
  "$VENV/bin/python" -m pip install -q "$MINDSPORE_SPEC" "numpy<2"
  # hyper_parallel itself, without its torch dependency (the workers also get the repo on
  # PYTHONPATH; this makes `import hyper_parallel` work in the venv for msrun jobs too)
  "$VENV/bin/python" -m pip install -q --no-deps -e .
fi
ready || { echo "error: $VENV has no working mindspore with numpy<2" >&2; exit 1; }
VENV_ABS="$(cd "$VENV" && pwd)"
echo "$VENV_ABS/bin/python"
