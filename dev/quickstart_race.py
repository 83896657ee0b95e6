"""The CPU quick start beside nanoGPT's own CPU command, interleaved, on the same machine:
whole-process wall time, and the time at which each first prints a val loss at or under the
target (the moment the eval line reaches stdout). BENCHMARKS.md "The CPU quick start".

    git clone https://github.com/karpathy/nanoGPT ../nanoGPT     # nanoGPT's own code
    python dev/quickstart_race.py --nanogpt=../nanoGPT --seeds=1337,1,2

nanoGPT's data is prepared in its checkout by its own data/shakespeare_char/prepare.py (from
../shared/data/tinyshakespeare/input.txt when that exists, else its download). nanoGPT fixes its
seed at 1337; ours takes --seed=S, so each round is nanoGPT's run, then ours with seed S.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NANOGPT_CPU = [
    "train.py",
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]
VAL = re.compile(r"step (\d+): .*val loss ([0-9.]+)")


def race(cmd, cwd, target):
    """(wall seconds, (step, seconds) of the first val <= target or None, last val) of one process."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *cmd], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first, last, lines = None, None, []
    for line in proc.stdout:
        lines.append(line)
        m = VAL.search(line)
        if m:
            last = float(m.group(2))
            if first is None and last <= target:
                first = (int(m.group(1)), time.perf_counter() - start)
    if proc.wait():
        sys.exit(f"{' '.join(cmd)} failed in {cwd}:\n" + "".join(lines[-20:]))
    return time.perf_counter() - start, first, last


def prepare_nanogpt(root):
    data = os.path.join(root, "data", "shakespeare_char")
    if os.path.exists(os.path.join(data, "meta.pkl")):
        return
    text = os.path.join(HERE, "..", "shared", "data", "tinyshakespeare", "input.txt")
    if os.path.exists(text):
        shutil.copy(text, os.path.join(data, "input.txt"))
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanogpt", required=True, help="a checkout of github.com/karpathy/nanoGPT")
    ap.add_argument("--seeds", default="1337,1,2")
    ap.add_argument("--target", type=float, default=1.88)
    ap.add_argument("--config", default="config/train_shakespeare_char_cpu.py")
    args = ap.parse_args()
    prepare_nanogpt(args.nanogpt)
    print(
        f"| seed | nanoGPT wall (s) | quick start wall (s) | its first eval <= {args.target} (step, s) | final val | "
        f"ratio to nanoGPT |\n|---|---|---|---|---|---|"
    )
    ratios = []
    for seed in args.seeds.split(","):
        nano_wall, _, nano_val = race(NANOGPT_CPU + [f"--out_dir=out-race-{seed}"], args.nanogpt, args.target)
        ours = ["train.py", args.config, f"--seed={seed}", f"--out_dir=out-race-{seed}", "--overwrite=True"]
        wall, first, val = race(ours, HERE, args.target)
        reached = f"{first[0]}, {first[1]:.1f}" if first else "never"
        ratio = first[1] / nano_wall if first else float("nan")
        ratios.append(ratio)
        print(
            f"| {seed} | {nano_wall:.1f} (val {nano_val:.4f}) | {wall:.1f} | {reached} | {val:.4f} | {ratio:.3f} |",
            flush=True,
        )
    print(f"median ratio (time to val <= {args.target} over nanoGPT's whole run): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
