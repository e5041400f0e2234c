"""Plot a run's TensorBoard scalars into one PNG (for docs and reports; needs matplotlib).

    python scripts/plot_curves.py outputs/debug/tb docs/debug_curves.png [tag ...]
"""
from __future__ import annotations

import sys

DEFAULT_TAGS = ["loss_metrics/global_avg_loss", "lr", "grad_norm", "throughput(tps)"]


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_curves needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir, out, tags = argv[0], argv[1], argv[2:] or DEFAULT_TAGS
    acc = EventAccumulator(logdir)
    acc.Reload()
    present = [t for t in tags if t in acc.Tags()["scalars"]]
    if not present:
        print(f"{logdir}: none of {', '.join(tags)} was logged", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2))
    for ax, tag in zip([axes] if len(present) == 1 else axes, present):
        events = acc.Scalars(tag)
        ax.plot([e.step for e in events], [e.value for e in events])
        ax.set_title(tag, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(f"wrote {out} ({', '.join(present)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
