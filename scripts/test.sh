#!/usr/bin/env bash
# Install the package with its test extras (CPU torch unless one is already installed) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test]"
# two workers of one thread each (tests/conftest.py): the tests' small models gain little from a second thread,
# and one pytest process left the second core mostly idle (10 minutes on 2 cores, 7 with two workers)
python3 -m pytest tests -q -n 2 --dist worksteal "$@"
