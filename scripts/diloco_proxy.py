"""DiLoCo against every-step replica groups at equal tokens, on the CPU quick start: for each
seed, two groups (train.py --ft_replica_group) train config/train_shakespeare_char_cpu.py with
gradient_accumulation_steps=2 (one micro-batch per group a step) once averaging their gradients
every step and once syncing with DiLoCo every sync_every steps; printed as a markdown table,
the final val loss of each (the groups' weights are equal at the end: max_iters is a multiple of
sync_every) and the bytes each group sent per step, on average.

    python data/shakespeare_char/prepare.py
    python scripts/diloco_proxy.py                                  # 3 seeds, 320 steps, H=8
    python scripts/diloco_proxy.py --seeds=1 --max_iters=80 --out_dir=/tmp/diloco_proxy
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from configurator import UserError, parse, run_main


@dataclasses.dataclass
class Args:
    seeds: int = 3  # seeds 0..seeds-1, each run both ways
    max_iters: int = 320  # steps per run; a multiple of sync_every, so DiLoCo ends on a sync
    sync_every: int = 8  # DiLoCo's H
    outer_lr: float = 0.7  # DiLoCo's outer learning rate
    outer_momentum: float = 0.9  # DiLoCo's outer Nesterov momentum
    timeout: float = 900.0  # seconds a run may take
    out_dir: str = "/tmp/diloco_proxy"  # scratch space, emptied first


def lighthouse(log):
    """(the torchft_lighthouse process, its address), waiting for both groups (min_replicas=2)."""
    binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [binary, "--min_replicas=2", "--join_timeout_ms=10000", "--bind=[::]:0"], stdout=f, stderr=subprocess.STDOUT
        )
    for _ in range(600):
        with open(log) as f:
            found = re.search(r"listening on: (\S+)", f.read())
        if found:
            return proc, found.group(1)
        time.sleep(0.05)
    proc.kill()
    raise UserError(f"torchft_lighthouse did not start; see {log}")


def one_run(args, seed, sync_every, out_dir):
    """(final val loss of group 0, mean bytes sent per step) of one pair of groups."""
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    beacon, address = lighthouse(os.path.join(out_dir, "lighthouse.log"))
    keys = dict(
        out_dir=out_dir,
        seed=seed,
        gradient_accumulation_steps=2,
        max_iters=args.max_iters,
        lr_decay_iters=args.max_iters,
        eval_interval=args.max_iters,
        log_interval=1,
        ft_groups=2,
        ft_lighthouse=address,
        sync_every=sync_every,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    try:
        for g in range(2):
            cmd = [
                sys.executable,
                "train.py",
                "config/train_shakespeare_char_cpu.py",
                f"--ft_replica_group={g}",
                *(f"--{k}={v}" for k, v in keys.items()),
            ]
            with open(os.path.join(out_dir, f"group{g}.log"), "w") as f:
                procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT))
        for p in procs:
            p.wait(timeout=args.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        beacon.kill()
        beacon.wait()
    if any(p.returncode != 0 for p in procs):
        raise UserError(f"a group failed; see {out_dir}/group*.log")
    with open(os.path.join(out_dir, "group0", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = {r["iter"]: r["sync_bytes"] for r in records if "sync_bytes" in r}
    val = [r["val_loss"] for r in records if "val_loss" in r and r["iter"] == args.max_iters]
    return val[-1], sum(steps.values()) / len(steps)


def main(argv=None):
    args = parse(Args, argv)
    if not os.path.exists(os.path.join(REPO, "data", "shakespeare_char", "train.bin")):
        raise UserError("data/shakespeare_char/train.bin not found: run python data/shakespeare_char/prepare.py")
    if args.max_iters % args.sync_every:
        raise UserError(f"max_iters={args.max_iters} must be a multiple of sync_every={args.sync_every}")
    shutil.rmtree(args.out_dir, ignore_errors=True)
    ways = {"every step": 0, f"DiLoCo H={args.sync_every}": args.sync_every}
    results = {
        way: [one_run(args, seed, h, os.path.join(args.out_dir, f"seed{seed}-h{h}")) for seed in range(args.seeds)]
        for way, h in ways.items()
    }
    print(
        f"2 groups, {args.max_iters} steps, config/train_shakespeare_char_cpu.py, gradient_accumulation_steps=2; "
        f"DiLoCo outer_lr={args.outer_lr}, outer_momentum={args.outer_momentum}\n"
    )
    print(
        "| sync | " + " | ".join(f"val loss, seed {s}" for s in range(args.seeds)) + " | mean | bytes sent per step |"
    )
    print("|---|" + "---|" * (args.seeds + 2))
    for way, runs in results.items():
        mean = sum(v for v, _ in runs) / len(runs)
        print(f"| {way} | " + " | ".join(f"{v:.4f}" for v, _ in runs) + f" | {mean:.4f} | {runs[0][1]:,.0f} |")
    every, diloco = (results[w][0][1] for w in ways)
    print(f"\nDiLoCo sent {every / diloco:.1f}x fewer bytes per step")
    return 0


if __name__ == "__main__":
    run_main(main)
