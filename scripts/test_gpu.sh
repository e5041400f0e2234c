#!/usr/bin/env bash
# The GPU suite (tests marked `gpu`), in groups that run side by side on one GPU.
#
#   bash scripts/test_gpu.sh single   # one rank: TE layers, FP8 recipes, the fused head, metrics, FP8 against bf16
#                                     # over 200 steps of 1B-wide blocks, the acceptance test
#   bash scripts/test_gpu.sh shared   # 2 to 4 ranks sharing the GPU (TITAN_TE_SHARE_GPU=1, gloo)
#   bash scripts/test_gpu.sh auto     # activation_checkpoint.mode = auto on one rank and on 2 sharing the GPU:
#                                     # each run fills the card by design, so this group runs alone
#   bash scripts/test_gpu.sh all      # the three, one after the other
#   bash scripts/test_gpu.sh GROUP    # one group of a wave (layers, tracking_1b, acceptance, shared_tracking,
#                                     # shared_state, shared_elastic, shared_memory, shared_launcher, auto), e.g. to
#                                     # fit a time-limited session
#
# A wave's groups run at once, each logging to LOG_DIR (default gpu_logs/) as <group>.log; the script prints
# each group's pytest summary line and exits non-zero if any group failed, timed out, skipped a test or ran
# none (a GPU suite that skipped did not run). The two waves are kept apart because the acceptance test (1B
# preset shapes, checkpoints of several GB) and the shared-rank tests together can fill a 64 GB disk or an
# 80 GB GPU. On a GPU of less than 120 GiB the shared wave's groups run one after another (run side by side on
# an 80 GB H100 they ran out of memory). GROUP_TIMEOUT (seconds, default 560) bounds each group; AT_ONCE
# (default: all, or 1 under 120 GiB) sets how many groups run side by side.
set -uo pipefail
cd "$(dirname "$0")/.."
wave="${1:-all}"
logs="${LOG_DIR:-gpu_logs}"
mkdir -p "$logs"
limit="${GROUP_TIMEOUT:-560}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/tests"

gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
at_once="${AT_ONCE:-$([ "${gpu_gib:-0}" -ge $((120 * 1024)) ] && echo 99 || echo 1)}"

pids=() names=() failed_early=0
group() {  # group NAME PYTEST_ARGS...: start one group in the background (after earlier ones, past AT_ONCE)
  local name="$1"; shift
  if [ "${#pids[@]}" -ge "$at_once" ]; then finish || failed_early=1; fi
  timeout "$limit" python3 -m pytest -m gpu -q -s -p no:cacheprovider --durations=8 "$@" > "$logs/$name.log" 2>&1 &
  pids+=($!) names+=("$name")
}
finish() {  # wait for the started groups; print each one's summary; non-zero if any failed
  local failed=0 rc summary
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; rc=$?
    summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped)|no tests ran" "$logs/${names[$i]}.log" | tail -1)
    [ "$rc" -eq 124 ] && summary="timed out after ${limit}s"
    echo "${names[$i]}: exit $rc: ${summary:-no summary (see $logs/${names[$i]}.log)}"
    # a group that passed nothing (every test skipped: no GPU or no Transformer Engine) is a failure too
    [[ "$rc" -ne 0 || "$summary" != *passed* || "$summary" == *skipped* ]] && failed=1
  done
  pids=() names=()
  return $failed
}
wave_end() {  # finish the wave's last groups; non-zero if any group of the wave failed
  local ok=0
  finish || ok=1
  [ "$failed_early" -eq 0 ] || ok=1
  failed_early=0
  return $ok
}
layers() { group layers tests/test_te_gpu.py tests/test_loss.py tests/test_metrics.py -k "not tracks_bf16 and not mode_auto"; }
tracking_1b() { group tracking_1b tests/test_te_gpu.py -k "tracks_bf16"; }
acceptance() { group acceptance tests/test_acceptance_gpu.py; }
shared_tracking() { group shared_tracking tests/test_shared_gpu.py -k "init or track"; }
shared_state() { group shared_state tests/test_shared_gpu.py -k "gathers or scales or reshards"; }
shared_elastic() { group shared_elastic tests/test_shared_gpu.py -k "other_rank"; }
shared_memory() { group shared_memory tests/test_shared_gpu.py -k "(recomputed or planner) and not mode_auto"; }
shared_launcher() { group shared_launcher tests/test_shared_gpu.py -k "kill or hsdp or one_line"; }
single() { layers; tracking_1b; acceptance; wave_end; }
shared() { shared_tracking; shared_state; shared_elastic; shared_memory; shared_launcher; wave_end; }
auto() { group auto tests/test_te_gpu.py tests/test_shared_gpu.py -k "mode_auto"; }

status=0
case "$wave" in
  single) single || status=1 ;;
  shared) shared || status=1 ;;
  all) single || status=1; shared || status=1; auto; wave_end || status=1 ;;
  layers|tracking_1b|acceptance|shared_tracking|shared_state|shared_elastic|shared_memory|shared_launcher|auto)
    "$wave"; wave_end || status=1 ;;
  *) echo "test_gpu.sh: unknown wave or group '$wave' (single, shared, auto, all, or one group: layers, tracking_1b," \
          "acceptance, shared_tracking, shared_state, shared_elastic, shared_memory, shared_launcher)" >&2; exit 2 ;;
esac
exit $status
