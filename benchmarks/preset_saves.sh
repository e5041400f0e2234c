#!/usr/bin/env bash
# Three background saves of a full preset through the real launcher, then one synchronous final save:
# prints, per save, how long training waited, how long until it was on disk, and its size on disk.
#   bash benchmarks/preset_saves.sh [preset] [interval] [folder]      (default: llama3_1b_fp8 20 /tmp/presetsaves)
# The run folder is deleted at the end (a 1B FP8 checkpoint is ~13 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-llama3_1b_fp8}
interval=${2:-20}
folder=${3:-/tmp/presetsaves}
rm -rf "$folder"
steps=$((3 * interval + 5))
./run_train.sh --config "$preset" --job.dump_folder="$folder" --job.name=saves --training.steps="$steps" \
  --checkpoint.interval="$interval" --checkpoint.keep_latest_k=2 --metrics.log_freq=10 | tee "$folder.log"
ck="$folder/saves/checkpoint"
echo
echo "saves of $preset ($steps steps, interval $interval, async_mode from the preset):"
printf '%-8s %18s %12s %8s\n' step "training waited s" "on disk s" GB
sed -n 's/.*saved step \([0-9]*\) to [^ ]* (\([0-9.]*\) GB) in \([0-9.]*\)s, training waited \([0-9.]*\)s.*/\1 \4 \3 \2/p' \
  "$folder.log" | while read -r step waited total gb; do printf '%-8s %18s %12s %8s\n' "$step" "$waited" "$total" "$gb"; done
echo "complete checkpoints left: $(ls "$ck")"
ls "$ck" | grep -q '\.tmp$' && { echo "a .tmp folder was left"; exit 1; }
rm -rf "$folder"
