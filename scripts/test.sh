#!/usr/bin/env bash
# Install the package with its test extras (CPU torch unless one is already installed) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test]"
python3 -m pytest tests -q "$@"
