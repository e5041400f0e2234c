"""The default job, launched exactly as a user would: ./run_train.sh with no config arguments."""
import re
import subprocess

from conftest import ROOT

LINE = re.compile(r"step\s+(\d+)\s+loss\s+([0-9.]+)")


def test_default_run_trains_and_loss_falls(tmp_path):
    r = subprocess.run(["./run_train.sh", f"--job.dump_folder={tmp_path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [(int(s), float(loss)) for s, loss in LINE.findall(r.stdout)]
    assert steps[0][0] == 1 and steps[-1][0] == 200
    first, last = steps[0][1], steps[-1][1]
    assert last < 0.7 * first, steps  # at least 30% lower
    run = tmp_path / "debug"
    assert (run / "config.toml").is_file() and "done: step 200 of 200" in r.stdout
