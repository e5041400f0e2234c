"""Command-line entry: parse the config, build the Trainer, train. User mistakes exit 2, no traceback."""
from __future__ import annotations

import sys

from titan_te import config as config_mod
from titan_te.logging_setup import setup_logging

EXIT_CONFIG_ERROR = 2
EXIT_CHECKPOINT_ERROR = 3
EXIT_OUT_OF_MEMORY = 4


def _own_message(err: Exception) -> str:
    """The error's own message; a DataLoader worker's re-raised error carries the worker's traceback."""
    text = str(err)
    if "Original Traceback" in text:
        text = text.strip().splitlines()[-1].split("Error: ", 1)[-1]
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, args = config_mod.load(argv)
    except config_mod.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.help:
        sys.stdout.write(config_mod.help_text())
        return 0
    if args.print_config:
        sys.stdout.write(config_mod.to_toml(cfg))
        return 0
    setup_logging()
    from titan_te.checkpoint import CheckpointError
    from titan_te.parallel.dist import shutdown
    from titan_te.preemption import EXIT_PREEMPTED, Preempted
    from titan_te.trainer import OutOfMemory, Trainer

    clean = False  # every rank got here in step: an unexpected crash skips the exit barrier
    try:
        trainer = Trainer(cfg)
        try:
            trainer.train()
        finally:
            trainer.close()
        clean = True
    except config_mod.ConfigError as e:  # found only once data or hardware is touched
        clean = True
        print(f"config error: {_own_message(e)}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except CheckpointError as e:
        clean = True
        print(f"checkpoint error: {e}", file=sys.stderr)
        return EXIT_CHECKPOINT_ERROR
    except Preempted as e:
        clean = True
        print(f"preempted: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except OutOfMemory as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    finally:
        shutdown(clean)
    return 0
