#!/usr/bin/env bash
# torchrun launcher.  NGPU: processes on this node (default: visible CUDA GPUs, else 1);
# LOG_RANK: ranks that print (default 0); --config FILE (default train_configs/debug.toml);
# every other argument is a config override (--section.key=value).
set -euo pipefail
cd "$(dirname "$0")"
config=train_configs/debug.toml
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --config=*) config="${1#--config=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -z "${NGPU:-}" ]; then
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count() or 1)" 2>/dev/null || echo 1)
fi
export LOG_RANK=${LOG_RANK:-0}
exec torchrun --nproc_per_node="$NGPU" --local-ranks-filter="$LOG_RANK" --role rank --tee 3 \
  ${TORCHRUN_ARGS:-} train.py --config "$config" "${args[@]}"
