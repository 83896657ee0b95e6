"""Runs that lose a process, and runs that sync less: three trials on the CPU, each a markdown table.

    python data/shakespeare_char/prepare.py
    python dev/replica_trials.py --trial=restart                         # torchrun --max-restarts=3, 10 trials
    python dev/replica_trials.py --trial=restart --runs=3 --max_iters=200 --out_dir=/tmp/restart_trials
    python dev/replica_trials.py --trial=groups                          # torchft_lighthouse + 2 groups, 10 runs
    python dev/replica_trials.py --trial=groups --sync_every=4           # DiLoCo groups, killed between syncs
    python dev/replica_trials.py --trial=groups --ranks_per_group=2      # torchrun groups: torchrun restarts one
    python dev/replica_trials.py --trial=diloco                          # DiLoCo against every step: 3 seeds, 320 steps, H=8
    python dev/replica_trials.py --trial=diloco --runs=1 --max_iters=80 --out_dir=/tmp/diloco

restart: does a torchrun job come back from crashed workers, with the result of a job that never
crashed? Each trial runs `torchrun --standalone --nproc_per_node=2 --max-restarts=3 train.py` with
init_from=auto and a checkpoint every `every` steps. Once training is under way (metrics.jsonl has
a step past the newest checkpoint) one of the two workers, chosen at random, is SIGKILLed after a
random delay; torchrun stops the other and starts both again, and they resume from the newest
checkpoint. That happens `kills` times. A trial passes when the job exits 0 within `timeout` seconds
and its final ckpt.pt holds weights and optimizer state bitwise equal to those of the same job run
once without a kill. The jobs run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/distributed.md says
why: by default the restarted workers find the previous attempt's keys in torchrun's one TCPStore,
and gloo reads a dead worker's address, pytorch/pytorch#135712); --share_store=True runs torchrun's
default, to see it fail.

groups: fault-tolerant replica groups (train.py --ft_replica_group) under failure. Each run starts
torchft_lighthouse (min_replicas=1), then groups 0 and 1 with init_from=auto. Once both take part
in steps, one of them, chosen at random, is SIGKILLed after a random delay (0 to 3 s) and started
again at once; with ranks_per_group > 1 each group is a torchrun job (--max-restarts=3), one worker
of it is SIGKILLed, and torchrun starts the group again. Reported per run: whether both groups
ended within `timeout` seconds, the survivor's longest step (its stall: the failed all-reduce and
the quorum without the dead group), the time from the restart to the restarted group's first step
beside the survivor (start-up, quorum, healing), and whether the two groups' final weights and
optimizer states are bitwise equal (with DiLoCo: the weights and the outer state; each group's inner
optimizer keeps moments of its own data).

diloco: DiLoCo against every-step replica groups at equal tokens, on the CPU quick start. For each
seed, two groups train config/train_shakespeare_char_cpu.py with gradient_accumulation_steps=2 (one
micro-batch per group a step), once averaging their gradients every step and once syncing with
DiLoCo every sync_every steps: the final val loss of each (the groups' weights are equal at the end:
max_iters is a multiple of sync_every) and the bytes each group sent per step, on average.
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
from gpt.outdir import checkpoint

# per trial: runs (seeds for diloco), max_iters, sync_every, timeout
DEFAULTS = {"restart": (10, 300, 0, 300.0), "groups": (10, 4000, 0, 300.0), "diloco": (3, 320, 8, 900.0)}


@dataclasses.dataclass
class Args:
    trial: str = "restart"  # restart (torchrun --max-restarts), groups (torchft replica groups) or diloco
    runs: int = 0  # trials, each with processes killed; diloco: seeds. 0: 10, or 3 seeds
    max_iters: int = 0  # training steps per run; 0: 300 (restart), 4000 (groups), 320 (diloco)
    timeout: float = 0.0  # seconds a run may take; past it every process is killed and the run failed. 0: 300, or 900
    seed: int = 0  # of the kill times and the killed ranks or groups
    out_dir: str = ""  # scratch space, emptied first; "": /tmp/replica_trials_<trial>
    kills: int = 2  # restart: SIGKILLs per trial, at random times
    every: int = 10  # restart: a checkpoint every this many steps (eval_interval, always_save_checkpoint)
    share_store: bool = False  # restart: keep torchrun's default of one TCPStore for every restart
    sync_every: int = 0  # groups: DiLoCo every that many steps (a divisor of max_iters), 0 every step; diloco: H (0: 8)
    ranks_per_group: int = 1  # groups: above 1, each group a torchrun job of that many ranks (DDP inside)
    outer_lr: float = 0.7  # diloco: DiLoCo's outer learning rate
    outer_momentum: float = 0.9  # diloco: DiLoCo's outer Nesterov momentum


def with_defaults(args):
    if args.trial not in DEFAULTS:
        raise UserError(f"trial={args.trial!r} is not one of {', '.join(map(repr, DEFAULTS))}")
    runs, max_iters, sync_every, timeout = DEFAULTS[args.trial]
    args = dataclasses.replace(
        args,
        runs=args.runs or runs,
        max_iters=args.max_iters or max_iters,
        sync_every=args.sync_every or sync_every,
        timeout=args.timeout or timeout,
        out_dir=args.out_dir or f"/tmp/replica_trials_{args.trial}",
    )
    if args.sync_every and args.max_iters % args.sync_every:
        raise UserError(
            f"max_iters={args.max_iters} must be a multiple of sync_every={args.sync_every}, to end on a sync"
        )
    return args


# ---------------------------------------------------------------------------- what the trials share


def start(cmd, log, env=()):
    """`python CMD` in the repo root, its output to the file `log`, in a session of its own so that a
    run past its time is killed whole (torchrun and its workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **dict(env)}
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, *map(str, cmd)],
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def torchrun(n, restarts=3):
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", f"--max-restarts={restarts}"]


def flags(**keys):
    return [f"--{k}={v}" for k, v in keys.items()]


def lighthouse(log, min_replicas, join_timeout_ms):
    """(the torchft_lighthouse process, its address): a process of its own, as a user runs it."""
    binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    with open(log, "w") as f:
        command = [binary, f"--min_replicas={min_replicas}", f"--join_timeout_ms={join_timeout_ms}", "--bind=[::]:0"]
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT)
    for _ in range(600):
        with open(log) as f:
            found = re.search(r"listening on: (\S+)", f.read())
        if found:
            return proc, found.group(1)
        time.sleep(0.05)
    proc.kill()
    raise UserError(f"torchft_lighthouse did not start; see {log}")


def step_records(metrics):
    """The step records of a metrics.jsonl in order (a step that did not commit is logged again at the same iter)."""
    try:
        with open(metrics) as f:
            return [json.loads(line) for line in f if '"loss"' in line]
    except (OSError, ValueError):
        return []


def equal(x, y):
    """Two state dicts of the same keys, tensors bitwise equal, the rest equal."""
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)


def same_training_state(a, b, diloco=False):
    """Two checkpoints at the same step with bitwise equal weights and optimizer state (with DiLoCo:
    the outer state; each group's inner optimizer keeps moments of its own data)."""
    if a["iter_num"] != b["iter_num"] or not equal(a["model"], b["model"]):
        return False
    if diloco:
        a, b = a["outer"], b["outer"]
        if not equal(a["last_sync"], b["last_sync"]):
            return False
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    return sa.keys() == sb.keys() and all(equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------- restart


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


def restart_job(args, rng, out_dir, log):
    """(outcome, seconds, kills done, the final checkpoint's path or None) of one torchrun job."""
    shutil.rmtree(out_dir, ignore_errors=True)
    keys = dict(dataset="shakespeare_char", device="cpu", compile=False, out_dir=out_dir, init_from="auto")
    keys.update(n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=8, gradient_accumulation_steps=2)
    keys.update(max_iters=args.max_iters, lr_decay_iters=args.max_iters, warmup_iters=10, learning_rate=3e-3)
    keys.update(min_lr=3e-4, dropout=0.1, eval_interval=args.every, eval_iters=1, log_interval=1)
    keys.update(always_save_checkpoint=True, dist_timeout_s=60)
    store = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if args.share_store else "1"}
    start_time = time.monotonic()
    deadline = start_time + args.timeout
    kill_at = sorted(rng.uniform(0.1, 0.8) * args.max_iters for _ in range(args.kills))  # steps to kill after
    killed, last_kill = 0, 0.0
    metrics = os.path.join(out_dir, "metrics.jsonl")
    proc = start([*torchrun(2), "train.py", *flags(**keys)], log, store)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            # the next kill once the step is reached and the workers started after the last kill have logged
            due = (
                killed < len(kill_at)
                and max((r["iter"] for r in step_records(metrics)), default=-1) >= kill_at[killed]
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
    finally:
        timed_out = proc.poll() is None
        kill([proc])
    if timed_out:
        return "timeout", time.monotonic() - start_time, killed, None
    outcome = "exit 0" if proc.returncode == 0 else f"exit {proc.returncode}"
    return outcome, time.monotonic() - start_time, killed, os.path.join(out_dir, "ckpt.pt")


def restart_trials(args, rng):
    ref_dir = os.path.join(args.out_dir, "reference")
    outcome, seconds, _, path = restart_job(dataclasses.replace(args, kills=0), rng, ref_dir, ref_dir + ".log")
    if outcome != "exit 0":
        raise UserError(f"the uninterrupted job failed ({outcome}); see {ref_dir}.log")
    reference = checkpoint.load(path)
    print(f"reference: {args.max_iters} steps without a kill in {seconds:.1f} s")
    print("| trial | outcome | kills | resumes | seconds | final state equals the reference |")
    print("|---|---|---|---|---|---|")
    passed = 0
    for trial in range(args.runs):
        out_dir = os.path.join(args.out_dir, f"trial{trial}")
        outcome, seconds, killed, path = restart_job(args, rng, out_dir, out_dir + ".log")
        with open(out_dir + ".log") as f:
            resumes = f.read().count("init_from='auto': resuming")
        same = path is not None and os.path.exists(path) and same_training_state(checkpoint.load(path), reference)
        passed += outcome == "exit 0" and same
        print(f"| {trial} | {outcome} | {killed} | {resumes} | {seconds:.1f} | {'yes' if same else 'NO'} |", flush=True)
    print(f"{passed}/{args.runs} trials completed with the reference's final state")
    return 0 if passed == args.runs else 1


# ---------------------------------------------------------------------------- groups


def start_group(args, out_dir, g, address, log):
    keys = dict(dataset="shakespeare_char", device="cpu", compile=False, out_dir=out_dir, init_from="auto")
    keys.update(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4)
    keys.update(gradient_accumulation_steps=2 * args.ranks_per_group, max_iters=args.max_iters)
    keys.update(lr_decay_iters=args.max_iters, warmup_iters=10, learning_rate=1e-2, min_lr=1e-3, eval_interval=500)
    keys.update(eval_iters=2, log_interval=1, dist_timeout_s=60, ft_replica_group=g, ft_groups=2)
    keys.update(ft_lighthouse=address, sync_every=args.sync_every)
    launcher = torchrun(args.ranks_per_group) if args.ranks_per_group > 1 else []
    # a fresh store for each of torchrun's attempts (docs/fault_tolerance.md)
    return start([*launcher, "train.py", *flags(**keys)], log, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def records(out_dir, g):
    """{iter: the newest record of that step} of group g."""
    return {r["iter"]: r for r in step_records(os.path.join(out_dir, f"group{g}", "metrics.jsonl"))}


def shared_step(log, killed_at):
    """True once the restarted group's log has a step both groups took part in, past the step the
    survivor was at when the other died (the restarted group healed and jumped to it)."""
    with open(log) as f:
        return any(
            int(m.group(1)) > killed_at and "2/2 groups" in line for line in f if (m := re.match(r"iter (\d+):", line))
        )


def group_run(args, rng, out_dir):
    """(outcome, survivor's longest step in s, seconds from restart to the first shared step, equal)."""
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    beacon, address = lighthouse(os.path.join(out_dir, "lighthouse.log"), min_replicas=1, join_timeout_ms=1000)
    deadline = time.monotonic() + args.timeout
    procs = [start_group(args, out_dir, g, address, os.path.join(out_dir, f"group{g}.log")) for g in range(2)]
    victim, heal, killed_at = rng.randrange(2), None, 0
    try:
        wait = lambda ok: all(p.poll() is None for p in procs) and time.monotonic() < deadline and not ok()
        while wait(lambda: any(r.get("groups") == 2 for r in records(out_dir, victim).values())):
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 3))
        if args.ranks_per_group > 1:  # one worker of the torchrun job: torchrun restarts the group
            pids = subprocess.run(["pgrep", "-P", str(procs[victim].pid)], capture_output=True, text=True)
            os.kill(int(rng.choice(pids.stdout.split())), signal.SIGKILL)
            killed_at = max(records(out_dir, 1 - victim), default=0) + 1  # the victim logged this far at most
            restarted, log = time.monotonic(), os.path.join(out_dir, f"group{victim}.log")
        else:
            kill([procs[victim]])
            killed_at = max(records(out_dir, 1 - victim), default=0)
            restarted, log = time.monotonic(), os.path.join(out_dir, f"group{victim}.restart.log")
            procs[victim] = start_group(args, out_dir, victim, address, log)
        while wait(lambda: shared_step(log, killed_at)):
            time.sleep(0.05)
        heal = time.monotonic() - restarted if shared_step(log, killed_at) else None
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = any(p.poll() is None for p in procs)
        kill(procs)
        beacon.kill()
        beacon.wait()
    survivor = step_records(os.path.join(out_dir, f"group{1 - victim}", "metrics.jsonl"))
    stall = max((r["dt_ms"] for r in survivor if r["iter"] >= killed_at), default=0) / 1000
    if timed_out:
        return "timeout", stall, heal, False
    codes = [p.returncode for p in procs]
    if codes != [0, 0]:
        return f"exit {codes}", stall, heal, False
    a, b = (checkpoint.load(os.path.join(out_dir, f"group{g}", "ckpt.pt")) for g in range(2))
    return "completed", stall, heal, same_training_state(a, b, diloco=args.sync_every > 0)


def group_trials(args, rng):
    print("| run | outcome | survivor's longest step (s) | restart to shared step (s) | final states equal |")
    print("|---|---|---|---|---|")
    done, stalls, heals = 0, [], []
    for run in range(args.runs):
        outcome, stall, heal, same = group_run(args, rng, os.path.join(args.out_dir, f"run{run}"))
        done += outcome == "completed" and same
        stalls.append(stall)
        heals += [heal] if heal is not None else []
        heal_text = f"{heal:.1f}" if heal is not None else "n/a"
        print(f"| {run} | {outcome} | {stall:.2f} | {heal_text} | {'yes' if same else 'NO'} |", flush=True)
    median = sorted(heals)[len(heals) // 2] if heals else float("nan")
    print(
        f"{done}/{args.runs} runs completed with equal final states; longest survivor stall {max(stalls):.2f} s; "
        f"restart to shared step: median {median:.1f} s, max {max(heals, default=float('nan')):.1f} s"
    )
    return 0 if done == args.runs else 1


# ---------------------------------------------------------------------------- diloco


def diloco_run(args, seed, sync_every, out_dir):
    """(final val loss of group 0, mean bytes sent per step) of one pair of groups."""
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    beacon, address = lighthouse(os.path.join(out_dir, "lighthouse.log"), min_replicas=2, join_timeout_ms=10000)
    keys = dict(out_dir=out_dir, seed=seed, gradient_accumulation_steps=2, max_iters=args.max_iters)
    keys.update(lr_decay_iters=args.max_iters, eval_interval=args.max_iters, log_interval=1, ft_groups=2)
    keys.update(ft_lighthouse=address, sync_every=sync_every, outer_lr=args.outer_lr)
    keys.update(outer_momentum=args.outer_momentum)
    procs = []
    try:
        for g in range(2):
            cmd = ["train.py", "config/train_shakespeare_char_cpu.py", f"--ft_replica_group={g}", *flags(**keys)]
            procs.append(start(cmd, os.path.join(out_dir, f"group{g}.log")))
        for p in procs:
            p.wait(timeout=args.timeout)
    finally:
        kill(procs)
        beacon.kill()
        beacon.wait()
    if any(p.returncode != 0 for p in procs):
        raise UserError(f"a group failed; see {out_dir}/group*.log")
    with open(os.path.join(out_dir, "group0", "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    steps = {r["iter"]: r["sync_bytes"] for r in logged if "sync_bytes" in r}
    val = [r["val_loss"] for r in logged if "val_loss" in r and r["iter"] == args.max_iters]
    return val[-1], sum(steps.values()) / len(steps)


def diloco_trials(args, rng):
    ways = {"every step": 0, f"DiLoCo H={args.sync_every}": args.sync_every}
    results = {
        way: [diloco_run(args, seed, h, os.path.join(args.out_dir, f"seed{seed}-h{h}")) for seed in range(args.runs)]
        for way, h in ways.items()
    }
    print(
        f"2 groups, {args.max_iters} steps, config/train_shakespeare_char_cpu.py, gradient_accumulation_steps=2; "
        f"DiLoCo outer_lr={args.outer_lr}, outer_momentum={args.outer_momentum}\n"
    )
    print("| sync | " + " | ".join(f"val loss, seed {s}" for s in range(args.runs)) + " | mean | bytes sent per step |")
    print("|---|" + "---|" * (args.runs + 2))
    for way, runs in results.items():
        mean = sum(v for v, _ in runs) / len(runs)
        print(f"| {way} | " + " | ".join(f"{v:.4f}" for v, _ in runs) + f" | {mean:.4f} | {runs[0][1]:,.0f} |")
    every, diloco = (results[w][0][1] for w in ways)
    print(f"\nDiLoCo sent {every / diloco:.1f}x fewer bytes per step")
    return 0


def main(argv=None):
    args = with_defaults(parse(Args, argv))
    if not os.path.exists(os.path.join(REPO, "data", "shakespeare_char", "train.bin")):
        raise UserError("data/shakespeare_char/train.bin not found: run python data/shakespeare_char/prepare.py")
    shutil.rmtree(args.out_dir, ignore_errors=True)
    os.makedirs(args.out_dir)
    trials = {"restart": restart_trials, "groups": group_trials, "diloco": diloco_trials}[args.trial]
    return trials(args, random.Random(args.seed))


if __name__ == "__main__":
    run_main(main)
