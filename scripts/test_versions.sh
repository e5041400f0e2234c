#!/usr/bin/env bash
# The CPU suite on another Python and torch, in a virtual environment of its own (the README's supported range):
#
#   bash scripts/test_versions.sh 3.12 2.11.0      # python3.12 must be on PATH; torch from the package index
#   bash scripts/test_versions.sh 3.11 2.14.1 -k config
#
# Extra arguments go to pytest. The environments stay under VENV_ROOT (default ~/.cache/titan_te/venvs) for the
# next run. torch from PyPI is a CUDA build of several GB; it runs the CPU suite all the same.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  echo "usage: bash scripts/test_versions.sh PYTHON_VERSION TORCH_VERSION [pytest args]" >&2
  exit 2
fi
py="$1" torch_version="$2"
shift 2
python="$(command -v "python$py" || true)"
if [ -z "$python" ]; then
  echo "test_versions.sh: python$py is not on PATH" >&2
  exit 2
fi
venv="${VENV_ROOT:-$HOME/.cache/titan_te/venvs}/py$py-torch$torch_version"
[ -x "$venv/bin/python3" ] || "$python" -m venv "$venv"
"$venv/bin/python3" -m pip install -q "torch==$torch_version"
"$venv/bin/python3" -m pip install -q -e ".[test]"
# tests start train.py and ./run_train.sh as `python3`: the environment's own comes first on PATH
PATH="$venv/bin:$PATH" python3 -m pytest tests -q -n 2 -p no:cacheprovider "$@"
