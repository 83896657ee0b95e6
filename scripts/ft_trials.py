"""Fault-tolerant replica groups under failure: N runs of two groups (train.py --ft_replica_group),
each SIGKILLing one group at a random moment and restarting it.

    python data/shakespeare_char/prepare.py
    python scripts/ft_trials.py                          # 10 runs
    python scripts/ft_trials.py --runs=3 --max_iters=1000 --out_dir=/tmp/ft_trials
    python scripts/ft_trials.py --sync_every=4                   # DiLoCo groups, killed between syncs
    python scripts/ft_trials.py --ranks_per_group=2              # torchrun groups: a worker killed, torchrun restarts its group

Each run starts torchft_lighthouse (min_replicas=1), then groups 0 and 1 with
init_from=auto. Once both take part in steps, one of them, chosen at random, is SIGKILLed after a
random delay (0 to 3 s), and started again at once. With ranks_per_group > 1 each group is a
torchrun job (--max-restarts=3): one worker of it is SIGKILLed, and torchrun starts the group again. Reported per run: whether both groups ended
within `timeout` seconds (a run past it is killed and counts as failed), the survivor's longest
step (its stall: the failed all-reduce and the quorum without the dead group), the time from the
restart to the restarted group's first step beside the survivor (start-up, quorum, healing), and
whether the two groups' final weights and optimizer states are bitwise equal (with DiLoCo: the
weights and the outer state; each group's inner optimizer keeps moments of its own data).
"""

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import torch

from configurator import UserError, parse, run_main
from gpt import checkpoint


@dataclasses.dataclass
class Args:
    runs: int = 10  # runs, each with one group killed and restarted
    max_iters: int = 4000  # training steps per run: the survivor must still be running when the restart joins
    timeout: float = 300.0  # seconds a run may take; past it every process is killed and the run failed
    seed: int = 0  # of the kill times and the killed groups
    sync_every: int = 0  # DiLoCo every that many steps (a divisor of max_iters); 0: gradients averaged every step
    ranks_per_group: int = 1  # above 1: each group a torchrun job of that many ranks (DDP inside)
    out_dir: str = "/tmp/ft_trials"  # scratch space, emptied first


def lighthouse(log):
    """(the torchft_lighthouse process, its address): a process of its own, as a user runs it."""
    binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [binary, "--min_replicas=1", "--join_timeout_ms=1000", "--bind=[::]:0"], stdout=f, stderr=subprocess.STDOUT
        )
    for _ in range(600):
        with open(log) as f:
            found = re.search(r"listening on: (\S+)", f.read())
        if found:
            return proc, found.group(1)
        time.sleep(0.05)
    proc.kill()
    raise UserError(f"torchft_lighthouse did not start; see {log}")


def start(args, out_dir, g, lighthouse, log):
    keys = dict(
        dataset="shakespeare_char",
        device="cpu",
        compile=False,
        out_dir=out_dir,
        init_from="auto",
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=16,
        batch_size=4,
        gradient_accumulation_steps=2 * args.ranks_per_group,
        max_iters=args.max_iters,
        lr_decay_iters=args.max_iters,
        warmup_iters=10,
        learning_rate=1e-2,
        min_lr=1e-3,
        eval_interval=500,
        eval_iters=2,
        log_interval=1,
        dist_timeout_s=60,
        ft_replica_group=g,
        ft_groups=2,
        ft_lighthouse=lighthouse,
        sync_every=args.sync_every,
    )
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks_per_group}", "--max-restarts=3"]
        if args.ranks_per_group > 1
        else []
    )
    cmd = [sys.executable, *launcher, "train.py", *(f"--{k}={v}" for k, v in keys.items())]
    # a fresh store for each of torchrun's attempts (docs/fault_tolerance.md)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def logged(out_dir, g):
    """The group's step records in order (a step that did not commit is logged again at the same iter)."""
    try:
        with open(os.path.join(out_dir, f"group{g}", "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if '"loss"' in line]
    except (OSError, ValueError):
        return []


def records(out_dir, g):
    """{iter: the newest record of that step}."""
    return {r["iter"]: r for r in logged(out_dir, g)}


def shared_step(log, killed_at):
    """True once the restarted group's log has a step both groups took part in, past the step the
    survivor was at when the other died (the restarted group healed and jumped to it)."""
    with open(log) as f:
        return any(
            int(m.group(1)) > killed_at and "2/2 groups" in line for line in f if (m := re.match(r"iter (\d+):", line))
        )


def equal_states(out_dir, diloco):
    a, b = (checkpoint.load(os.path.join(out_dir, f"group{g}", "ckpt.pt")) for g in range(2))
    same = lambda x, y: all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
    if diloco:
        return (
            a["iter_num"] == b["iter_num"]
            and same(a["model"], b["model"])
            and same(a["outer"]["last_sync"], b["outer"]["last_sync"])
            and all(
                same(x, y)
                for x, y in zip(a["outer"]["optimizer"]["state"].values(), b["outer"]["optimizer"]["state"].values())
            )
        )
    return (
        a["iter_num"] == b["iter_num"]
        and same(a["model"], b["model"])
        and all(same(a["optimizer"]["state"][k], b["optimizer"]["state"][k]) for k in a["optimizer"]["state"])
    )


def one_run(args, rng, out_dir):
    """(outcome, survivor's longest step in s, seconds from restart to the first shared step, equal)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    beacon, address = lighthouse(os.path.join(out_dir, "lighthouse.log"))
    deadline = time.monotonic() + args.timeout
    procs = [start(args, out_dir, g, address, os.path.join(out_dir, f"group{g}.log")) for g in range(2)]
    victim, heal, killed_at = rng.randrange(2), None, 0
    try:
        wait = lambda ok: all(p.poll() is None for p in procs) and time.monotonic() < deadline and not ok()
        while wait(lambda: any(r.get("groups") == 2 for r in records(out_dir, victim).values())):
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 3))
        if args.ranks_per_group > 1:  # one worker of the torchrun job: torchrun restarts the group
            workers = subprocess.run(
                ["pgrep", "-P", str(procs[victim].pid)], capture_output=True, text=True
            ).stdout.split()
            os.kill(int(rng.choice(workers)), signal.SIGKILL)
            killed_at = max(records(out_dir, 1 - victim), default=0) + 1  # the victim logged this far at most
            restarted, log = time.monotonic(), os.path.join(out_dir, f"group{victim}.log")
        else:
            os.killpg(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait()
            killed_at = max(records(out_dir, 1 - victim), default=0)
            restarted, log = time.monotonic(), os.path.join(out_dir, f"group{victim}.restart.log")
            procs[victim] = start(args, out_dir, victim, address, log)
        while wait(lambda: shared_step(log, killed_at)):
            time.sleep(0.05)
        heal = time.monotonic() - restarted if shared_step(log, killed_at) else None
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = any(p.poll() is None for p in procs)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        beacon.kill()
        beacon.wait()
    stall = max((r["dt_ms"] for r in logged(out_dir, 1 - victim) if r["iter"] >= killed_at), default=0) / 1000
    if timed_out:
        return "timeout", stall, heal, False
    codes = [p.returncode for p in procs]
    outcome = "completed" if codes == [0, 0] else f"exit {codes}"
    return outcome, stall, heal, outcome == "completed" and equal_states(out_dir, args.sync_every > 0)


def main(argv=None):
    args = parse(Args, argv)
    if args.sync_every and args.max_iters % args.sync_every:
        raise UserError(
            f"max_iters={args.max_iters} must be a multiple of sync_every={args.sync_every}, to end on a sync"
        )
    if not os.path.exists(os.path.join(REPO, "data", "shakespeare_char", "train.bin")):
        raise UserError("data/shakespeare_char/train.bin not found: run python data/shakespeare_char/prepare.py")
    shutil.rmtree(args.out_dir, ignore_errors=True)
    rng = random.Random(args.seed)
    print("| run | outcome | survivor's longest step (s) | restart to shared step (s) | final states equal |")
    print("|---|---|---|---|---|")
    done, stalls, heals = 0, [], []
    for run in range(args.runs):
        outcome, stall, heal, equal = one_run(args, rng, os.path.join(args.out_dir, f"run{run}"))
        done += outcome == "completed" and equal
        stalls.append(stall)
        heals += [heal] if heal is not None else []
        heal_text = f"{heal:.1f}" if heal is not None else "n/a"
        print(f"| {run} | {outcome} | {stall:.2f} | {heal_text} | {'yes' if equal else 'NO'} |", flush=True)
    print(
        f"{done}/{args.runs} runs completed with equal final states; longest survivor stall {max(stalls):.2f} s; "
        f"restart to shared step: median {sorted(heals)[len(heals) // 2] if heals else float('nan'):.1f} s, "
        f"max {max(heals, default=float('nan')):.1f} s"
    )
    return 0 if done == args.runs else 1


if __name__ == "__main__":
    run_main(main)
