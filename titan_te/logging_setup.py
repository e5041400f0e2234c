"""Console logging: the ranks in LOG_RANK (default 0) print INFO, the others only warnings and errors.

Every line is tagged with the rank on multi-process runs. The run's log file (run_folder.py) gets
everything of its rank, whatever the console shows.
"""
from __future__ import annotations

import logging
import os
import sys


# how torch's SIGCHLD handler and its data-queue wait name a loader worker that ended in their RuntimeError
# (data/loader.py's worker_death reads the rest)
WORKER_DEATH = "DataLoader worker (pid"


class SignalErrorsPass:
    """A handler mixin: torch's RuntimeError for a data-loader worker that died, raised into the main thread by
    its SIGCHLD handler while a line was being written, goes on to the code that logged the line (the trainer
    turns it into its one line) instead of being printed and swallowed as a "--- Logging error ---". Every
    other error stays logging's: e.g. "reentrant call" when our SIGTERM handler logs while the interrupted
    main thread was writing to the same stream, which must not stop the save that SIGTERM asks for."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 -- logging's name
        err = sys.exc_info()[1]
        if isinstance(err, RuntimeError) and WORKER_DEATH in str(err):
            raise  # logging calls handleError inside its `except`: this re-raises that error
        super().handleError(record)


class ConsoleHandler(SignalErrorsPass, logging.StreamHandler):
    pass


def setup_logging() -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    show = {int(r) for r in os.environ.get("LOG_RANK", "0").split(",") if r.strip().isdigit()}
    if not any(r < world for r in show):  # e.g. LOG_RANK=5 on one process: never a silent run
        if rank == 0:
            print(f"warning: LOG_RANK={os.environ.get('LOG_RANK')} names no rank of this run ({world} "
                  f"process(es)); rank 0 prints", file=sys.stdout)
        show = {0}
    handler = ConsoleHandler(sys.stdout)
    prefix = f"[rank{rank}] " if world > 1 else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
    handler.setLevel(logging.INFO if rank in show else logging.WARNING)
    log = logging.getLogger("titan_te")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
