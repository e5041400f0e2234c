"""Entry point: python train.py --config FILE [--section.key=value ...] (or use ./run_train.sh)."""
import sys

from titan_te.main import main

if __name__ == "__main__":
    sys.exit(main(exits_after=True))
