"""Plot runs side by side from their metrics.jsonl: loss, learning rate and throughput
against iterations, one colour per run; HellaSwag accuracy, CORE, and scripts/chat_rl.py's reward and pass@k too when a run logged them,
in the loop or by a watcher (eval.py --watch, its watch/ records: dashed, at the checkpoints' steps).

    python plot.py out-shakespeare-char                        # writes out-shakespeare-char/metrics.png
    python plot.py out-a out-b --out=compare.png               # two runs on the same axes
    python plot.py out-a/metrics.jsonl out-b/metrics.jsonl --out=compare.png
"""

import json
import os
import sys

from configurator import Parser, run_main


def metrics_file(path):
    """An out_dir's metrics.jsonl, or the path itself when it names a file."""
    return os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path


def read_run(path):
    """(label, records): the run's directory name and its metrics."""
    file = metrics_file(path)
    if not os.path.isfile(file):
        sys.exit(f"error: {file} not found: pass an out_dir of train.py or its metrics.jsonl")
    records = []
    with open(file) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    sys.exit(f"error: {file}:{n} is not a JSON line; is this a train.py metrics.jsonl?")
    if not any("iter" in r for r in records):
        sys.exit(f"error: {file} has no records with an 'iter'; is this a train.py metrics.jsonl?")
    label = os.path.basename(os.path.dirname(os.path.abspath(file)))
    return label, records


def series(records, key):
    points = [(r["iter"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def watched(ax, records, key, label, color):
    """A watcher's records of `key` (eval.py --watch: watch/<key>), dotted, at the checkpoints' steps."""
    x, y = series(records, "watch/" + key)
    if x:
        ax.plot(x, y, color=color, marker="s", markersize=3, linestyle=":", label=label)


def plot(runs, out):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    logged = lambda key: any(
        r.get(key) is not None or r.get("watch/" + key) is not None for _, records in runs for r in records
    )
    hellaswag, core, rl = logged("hellaswag_acc"), logged("core"), logged("reward")
    titles = ["loss", "learning rate", "tokens/s"] + ["HellaSwag"] * hellaswag + ["CORE"] * core
    titles += ["reward (scripts/chat_rl.py), pass@k held out"] * rl
    fig, axes = plt.subplots(1, len(titles), figsize=(5.3 * len(titles), 4.5))
    loss_ax, lr_ax, speed_ax = axes[:3]
    for i, (label, records) in enumerate(runs):
        color = f"C{i}"
        x, y = series(records, "loss")
        loss_ax.plot(x, y, color=color, alpha=0.35, linewidth=0.8, label=f"{label} train (batch)")
        x, y = series(records, "val_loss")
        loss_ax.plot(x, y, color=color, marker="o", markersize=3, label=f"{label} val")
        x, y = series(records, "test_loss")
        if x:
            loss_ax.plot(x, y, color=color, marker="x", markersize=8, linestyle="none", label=f"{label} test")
        watched(loss_ax, records, "val_loss", f"{label} val (watcher)", color)
        if hellaswag:
            axes[3].plot(
                *series(records, "hellaswag_acc_norm"),
                color=color,
                marker="o",
                markersize=3,
                label=f"{label} acc_norm_tokens",
            )
            axes[3].plot(*series(records, "hellaswag_acc"), color=color, linestyle="--", label=f"{label} acc")
            watched(axes[3], records, "hellaswag_acc_norm", f"{label} acc_norm_tokens (watcher)", color)
        if core:
            axes[3 + hellaswag].plot(
                *series(records, "core"), color=color, marker="o", markersize=3, label=f"{label} CORE"
            )
            watched(axes[3 + hellaswag], records, "core", f"{label} CORE (watcher)", color)
        if rl:
            axes[-1].plot(*series(records, "reward"), color=color, alpha=0.5, linewidth=0.8, label=f"{label} reward")
            passes = sorted({k for r in records for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))
            for k in passes[:1] + passes[-1:] if len(passes) > 1 else passes:
                marker = "o" if k == "pass@1" else "^"
                axes[-1].plot(*series(records, k), color=color, marker=marker, markersize=3, label=f"{label} {k}")
        lr_ax.plot(*series(records, "lr"), color=color, label=label)
        speed_ax.plot(*series(records, "tokens_per_s"), color=color, label=label)
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="out_dirs of train.py, or metrics.jsonl files")
    parser.add_argument("--out", help="PNG to write (default: metrics.png in the first run's directory)")
    args = parser.parse_args(argv)
    runs = [read_run(path) for path in args.runs]
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(metrics_file(args.runs[0]))), "metrics.png")
    try:
        plot(runs, out)
    except OSError as e:
        sys.exit(f"error: cannot write {out} ({e.strerror or e}); choose another --out")
    print(f"wrote {out}")


if __name__ == "__main__":
    run_main(main)
