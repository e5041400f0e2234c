"""Command-line entry: parse the config, build the Trainer, train.

A user mistake or condition (titan_te.errors.UserError) prints one line on stderr and exits with its
code: 2 config/data, 3 checkpoint, 4 out of memory, 75 preempted; a stop signal before training
started is one line too (exit 128 + N), and so is a collective that failed because another rank went away
(exit 1; the traceback goes to the run's log file). Anything else is a bug: traceback, exit code 1.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import NoReturn

from titan_te.errors import Interrupted, UserError, say
from titan_te.preemption import SIGNALS

logger = logging.getLogger("titan_te")
LOST_RANK_WAIT_S = 3.0


def _own_message(err: UserError) -> str:
    """The error's line; a DataLoader worker's re-raised error carries the worker's traceback."""
    text = err.line()
    if "Original Traceback" in text:
        text = f"{err.prefix}: " + text.strip().splitlines()[-1].split("Error: ", 1)[-1]
    return text


def main(argv: list[str] | None = None, exits_after: bool = False) -> int:
    """`exits_after`: called as the process's entry point (train.py), which exits right after."""
    with SIGNALS.installed(for_good=exits_after):  # before anything else: a Ctrl-C during the imports is one line too
        try:
            _tell_the_launcher()
            return _main(sys.argv[1:] if argv is None else argv)
        except BaseException as e:  # noqa: BLE001 -- re-raised unless it is the user's stop
            code = SIGNALS.report_stop(e)  # the run's log file keeps the traceback of an error made of it
            if code is None:
                raise
            return code


def leave(code: int) -> NoReturn:
    """End the process (train.py's last act) as an exit does, less its final collection of every module.

    The other threads are waited for and the atexit handlers run, as at any exit; then the process ends without
    tearing down the imported modules, which with torch loaded takes longer than a short run's training (the
    README has the figures). Nothing of ours waits for that teardown: every file this package writes is on disk
    line by line (a kill -9 loses nothing), and the process group is gone. Where Python lacks the two calls, it
    is a plain exit."""
    import atexit
    import threading

    shutdown_threads = getattr(threading, "_shutdown", None)  # what an exit calls first: joins the threads
    run_exit_functions = getattr(atexit, "_run_exitfuncs", None)
    if shutdown_threads is None or run_exit_functions is None:
        sys.exit(code)
    shutdown_threads()
    run_exit_functions()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed console (EIO, EPIPE): nothing left to say there
            pass
    os._exit(code)


def _tell_the_launcher() -> None:
    """Under ./run_train.sh: the handlers are in place, so the launcher may forward stop signals now (it
    started this process with them ignored); a launcher that died while this one started is a stop."""
    fd = os.environ.pop("TITAN_TE_READY_FD", "")
    if fd:
        try:
            os.write(int(fd), b"1")
            os.close(int(fd))
        except (OSError, ValueError):
            pass
    launcher = os.environ.get("TITAN_TE_LAUNCHER_PID", "")
    if launcher.isdigit() and os.getppid() != int(launcher):
        import signal

        raise Interrupted(signal.SIGTERM, "starting (the launcher is gone)")


def set_environment_defaults(env=os.environ) -> None:
    """What a training process sets before torch starts CUDA, each only where the user has not:

    - torch's C++ warnings off (a rendezvous retrying its connection prints twenty lines a second and would bury
      the one line a user needs); TORCH_CPP_LOG_LEVEL=INFO brings them back;
    - CUDA's caching allocator growing its segments in place (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
      as torchtitan's launcher sets it): with fixed segments the free memory of a run near the card's capacity
      lies in pieces too small for one large buffer (the README's planner section has the run that showed it).
      Any PYTORCH_CUDA_ALLOC_CONF of the user's is kept whole."""
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _main(argv: list[str]) -> int:
    set_environment_defaults()
    from pathlib import Path

    from titan_te import config as config_mod
    from titan_te.logging_setup import setup_logging

    SIGNALS.doing("reading the config")
    try:
        cfg, args = config_mod.load(argv)
    except UserError as e:
        say(e.line())
        return e.exit_code
    if args.help:
        sys.stdout.write(config_mod.help_text(cfg if args.config_file else None, Path(args.config_file or "").name))
        return 0
    if args.print_config:
        sys.stdout.write(config_mod.to_toml(cfg))
        return 0
    setup_logging()
    from titan_te.parallel.dist import shutdown

    clean = False  # an unexpected crash skips the exit barrier
    try:
        code, line, clean = _train(cfg)
        SIGNALS.decided = code
        if line:
            say(line)
    finally:
        shutdown(clean)  # _train has returned: the Trainer is unreachable and freed there
    return code


def _train(cfg) -> tuple[int, str | None, bool]:
    """(exit code, the one line for stderr, whether every rank got here in step)."""
    from titan_te.parallel.dist import lost_rank
    from titan_te.trainer import Trainer

    try:
        with Trainer(cfg) as trainer:
            trainer.train()
    except UserError as e:
        return e.exit_code, _own_message(e), e.exit_code != 4  # after an out-of-memory ranks may be out of step
    except RuntimeError as e:
        lost = lost_rank(e)  # not this rank's failure: one line here, the traceback in the run's log file
        if lost is None or SIGNALS.stop_behind(e) is not None:  # a start-up stop: the other rank stopped too
            raise
        time.sleep(LOST_RANK_WAIT_S)  # the rank that went away exits first: the launcher reports it, not this one
        return 1, f"lost a rank: {lost}", False
    return 0, None, True
