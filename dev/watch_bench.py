"""Training step time with a watcher beside the run (eval_async=True) against without one.

    python data/shakespeare_char/prepare.py
    python dev/watch_bench.py                                   # the CPU quick-start config, 2 reps
    python dev/watch_bench.py --reps=3 --max_iters=400 --eval_interval=50 --out_dir=/tmp/watch_bench

train.py runs config/train_shakespeare_char_cpu.py (checkpoints every eval_interval steps,
keep_last=2) twice per repetition, without and with eval_async=True (the watcher on the CPU,
scoring val at each checkpoint), interleaved. Reported: the median ms/iter of the logged windows
(metrics.jsonl's dt_ms, the first window left out: it holds the warm-up) and the run's wall time,
which includes waiting for the watcher at the end. On a GPU node the watcher runs on a device of
its own (eval_async_device), so it takes nothing from the training's device.
"""

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from configurator import UserError, parse, run_main


@dataclasses.dataclass
class Args:
    reps: int = 2  # repetitions, each running both modes
    max_iters: int = 300  # training steps per run
    eval_interval: int = 50  # a checkpoint (and so a watcher's score) every this many steps
    out_dir: str = "/tmp/watch_bench"  # scratch space, emptied first


def run(args, eval_async):
    out = os.path.join(args.out_dir, "async" if eval_async else "sync")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "train.py",
        "config/train_shakespeare_char_cpu.py",
        f"--out_dir={out}",
        "--log_interval=10",
        f"--max_iters={args.max_iters}",
        f"--lr_decay_iters={args.max_iters}",
        f"--eval_interval={args.eval_interval}",
        "--always_save_checkpoint=True",
        "--keep_last=2",
        f"--eval_async={eval_async}",
    ]
    start = time.perf_counter()
    if subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL).returncode != 0:
        raise UserError("train.py failed (its error is above); nothing was measured")
    wall = time.perf_counter() - start
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    dts = [r["dt_ms"] for r in records if "dt_ms" in r][1:]
    return statistics.median(dts), wall, sum(1 for r in records if "watch/val_loss" in r)


def main(argv=None):
    args = parse(Args, argv)
    results = {False: [], True: []}
    for _ in range(args.reps):
        for eval_async in (False, True):
            results[eval_async].append(run(args, eval_async))
    print("| watcher | ms/iter (median) | run wall time | checkpoints scored |")
    print("|---|---|---|---|")
    for eval_async, rows in results.items():
        ms = statistics.median(r[0] for r in rows)
        wall = statistics.median(r[1] for r in rows)
        print(f"| {'eval_async=True (CPU)' if eval_async else 'none'} | {ms:.1f} | {wall:.1f} s | {rows[0][2]} |")


if __name__ == "__main__":
    run_main(main)
