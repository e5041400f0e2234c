#!/usr/bin/env bash
# Launch training: NGPU processes on this node (default: the visible CUDA GPUs, else 1), LOG_RANK the
# ranks that print (default 0), --config FILE or a preset name (default train_configs/debug.toml);
# every other argument is a config override (--section.key=value). Multi-node: NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT. Exit codes are train.py's: 0 done, 2 config/data, 3 checkpoint, 4 out of
# memory, 75 preempted (rerun to resume). See titan_te/launcher.py.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m titan_te.launcher "$@"
