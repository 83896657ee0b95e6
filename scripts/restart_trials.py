"""Does a torchrun job come back from crashed workers, and is the result the same as if nothing
had happened? N trials of a 2-rank gloo job under torchrun --max-restarts=3, each SIGKILLing a
worker twice at random times.

    python data/shakespeare_char/prepare.py
    python scripts/restart_trials.py                      # 10 trials
    python scripts/restart_trials.py --trials=3 --max_iters=200 --out_dir=/tmp/restart_trials

Every trial runs `torchrun --standalone --nproc_per_node=2 --max-restarts=3 train.py` with
init_from=auto and a checkpoint every `every` steps. Once training is under way (metrics.jsonl
has a step past the newest checkpoint) one of the two workers, chosen at random, is SIGKILLed
after a random delay; torchrun stops the other and starts both again, and they resume from the
newest checkpoint. That happens twice. A trial passes when the job exits 0 within `timeout`
seconds (a timeout is a failure: the job is killed) and its final ckpt.pt holds weights and
optimizer state bitwise equal to those of the same job run once without a kill.

The jobs run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/distributed.md says why): by default
torchrun's c10d rendezvous keeps one TCPStore for the whole job, and the restarted workers find
the previous attempt's keys in it; gloo (and NCCL) then read a dead worker's address and fail to
connect (pytorch/pytorch#135712). --share_store=True runs torchrun's default, to see it fail.
"""

import dataclasses
import os
import random
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
    trials: int = 10  # jobs, each with `kills` workers SIGKILLed
    kills: int = 2  # SIGKILLs per trial, at random times
    max_iters: int = 300  # training steps per job
    every: int = 10  # a checkpoint every this many steps (eval_interval, always_save_checkpoint)
    timeout: float = 300.0  # seconds a job may take; past it the job is killed and the trial failed
    seed: int = 0  # of the kill times and the killed ranks
    share_store: bool = False  # keep torchrun's default of one TCPStore for every restart (see the docstring)
    out_dir: str = "/tmp/restart_trials"  # scratch space, emptied first


def train_args(args, out_dir):
    keys = dict(
        dataset="shakespeare_char",
        device="cpu",
        compile=False,
        out_dir=out_dir,
        init_from="auto",
        n_layer=2,
        n_head=2,
        n_embd=64,
        block_size=32,
        batch_size=8,
        gradient_accumulation_steps=2,
        max_iters=args.max_iters,
        lr_decay_iters=args.max_iters,
        warmup_iters=10,
        learning_rate=3e-3,
        min_lr=3e-4,
        dropout=0.1,
        eval_interval=args.every,
        eval_iters=1,
        log_interval=1,
        always_save_checkpoint=True,
        dist_timeout_s=60,
    )
    return [f"--{k}={v}" for k, v in keys.items()]


def launch(args, out_dir, log):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=3",
        "train.py",
        *train_args(args, out_dir),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if args.share_store else "1",
    }
    # a session of its own, so a timed-out job is killed whole (torchrun and its workers)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def workers(launcher_pid):
    """The pids of torchrun's worker processes (its children running train.py)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == launcher_pid and b"train.py" in cmdline:
            found.append(int(entry))
    return sorted(found)


def logged_iter(out_dir):
    """The newest step in metrics.jsonl (-1 before the first)."""
    try:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            lines = [line for line in f if '"loss"' in line]
    except OSError:
        return -1
    return max((int(line.split('"iter": ', 1)[1].split(",", 1)[0]) for line in lines), default=-1)


def run_trial(args, rng, out_dir, log_path):
    """(outcome, seconds, restarts seen, the final checkpoint's path or None)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    start = time.monotonic()
    deadline = start + args.timeout
    kill_at = sorted(rng.uniform(0.1, 0.8) * args.max_iters for _ in range(args.kills))  # steps to kill after
    killed, last_kill = 0, 0.0
    metrics = os.path.join(out_dir, "metrics.jsonl")
    with open(log_path, "w") as log:
        proc = launch(args, out_dir, log)
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
                # the next kill once the step is reached and the workers started after the last kill have logged
                due = (
                    killed < len(kill_at)
                    and logged_iter(out_dir) >= kill_at[killed]
                    and os.path.exists(metrics)
                    and os.path.getmtime(metrics) > last_kill
                )
                pids = workers(proc.pid) if due else []
                if len(pids) == 2:
                    time.sleep(rng.uniform(0, 0.5))  # a random moment inside the step, the eval or the save
                    try:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    killed, last_kill = killed + 1, time.time()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return "timeout", time.monotonic() - start, killed, None
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    outcome = "exit 0" if proc.returncode == 0 else f"exit {proc.returncode}"
    return outcome, time.monotonic() - start, killed, os.path.join(out_dir, "ckpt.pt")


def same_state(path, reference):
    """True when the two checkpoints hold bitwise equal weights and optimizer state, at the same step."""
    a, b = checkpoint.load(path), reference
    if a["iter_num"] != b["iter_num"] or a["model"].keys() != b["model"].keys():
        return False
    if not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
        return False
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(x, y) for k in sa for x, y in zip(sa[k].values(), sb[k].values()) if torch.is_tensor(x)
    )


def main(argv=None):
    args = parse(Args, argv)
    if not os.path.exists(os.path.join(REPO, "data", "shakespeare_char", "train.bin")):
        raise UserError("data/shakespeare_char/train.bin not found: run python data/shakespeare_char/prepare.py")
    shutil.rmtree(args.out_dir, ignore_errors=True)
    os.makedirs(args.out_dir)
    rng = random.Random(args.seed)
    ref_dir = os.path.join(args.out_dir, "reference")
    outcome, seconds, _, path = run_trial(dataclasses.replace(args, kills=0), rng, ref_dir, ref_dir + ".log")
    if outcome != "exit 0":
        raise UserError(f"the uninterrupted job failed ({outcome}); see {ref_dir}.log")
    reference = checkpoint.load(path)
    print(f"reference: {args.max_iters} steps without a kill in {seconds:.1f} s")
    print("| trial | outcome | kills | resumes | seconds | final state equals the reference |")
    print("|---|---|---|---|---|---|")
    passed = 0
    for trial in range(args.trials):
        out_dir = os.path.join(args.out_dir, f"trial{trial}")
        outcome, seconds, killed, path = run_trial(args, rng, out_dir, out_dir + ".log")
        with open(out_dir + ".log") as f:
            resumes = f.read().count("init_from='auto': resuming")
        equal = path is not None and os.path.exists(path) and same_state(path, reference)
        passed += outcome == "exit 0" and equal
        print(
            f"| {trial} | {outcome} | {killed} | {resumes} | {seconds:.1f} | {'yes' if equal else 'NO'} |", flush=True
        )
    print(f"{passed}/{args.trials} trials completed with the reference's final state")
    return 0 if passed == args.trials else 1


if __name__ == "__main__":
    run_main(main)
