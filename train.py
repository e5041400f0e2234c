"""Entry point: python train.py --config FILE [--section.key=value ...] (or use ./run_train.sh)."""
from titan_te.main import leave, main

if __name__ == "__main__":
    leave(main(exits_after=True))
