"""The command line of the tools (`prepare`, `export`): the same contract as train.py's.

A mistake on the command line, in the input or in the environment is one line on stderr with the
tool's prefix and exit code 2; a stop signal is one line and exit 128 + N (what the tool was writing
is not published); a bug in titan_te keeps its traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from titan_te.errors import UserError, say
from titan_te.preemption import SIGNALS


class UsageError(UserError):
    exit_code = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes raise UsageError (one line) instead of printing usage and exiting."""

    def error(self, message: str):  # noqa: D102 -- argparse's hook
        raise UsageError(f"{message} (see {self.prog} --help)")


def run_tool(prefix: str, body: Callable[[], int], exits_after: bool = False) -> int:
    """Run a tool's `body` with the stop signals handled and every UserError as `<prefix>: <line>`."""
    with SIGNALS.installed(for_good=exits_after):
        try:
            return body()
        except UserError as e:
            say(f"{prefix}: {e.msg}" if not e.msg.startswith(f"{prefix}:") else e.msg)
            return 2
        except BaseException as e:  # noqa: BLE001 -- re-raised unless it is the user's stop
            code = SIGNALS.report_stop(e)
            if code is None:
                raise
            return code


def stderr_is_clean() -> None:
    """Drop library warnings a tool's user cannot act on (e.g. DCP's 'torch.distributed is disabled ...'
    when a tool reads a checkpoint in one process, as it means to)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
    sys.stderr.flush()
