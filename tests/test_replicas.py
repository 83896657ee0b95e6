"""Fault-tolerant replica groups (gpt/replicas.py, torchft): two groups of one process each,
meeting at a torchft lighthouse, train as plain 2-rank DDP does; one group
SIGKILLed mid-run leaves the other stepping alone, and restarted it heals from the live one to
the same weights, bit for bit."""

import os
import re
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch

from conftest import REPO, read_metrics, tiny_args

from gpt import checkpoint
from model import GPT, GPTConfig

torchft = pytest.importorskip("torchft")

COMMON = dict(max_iters=24, lr_decay_iters=24, eval_interval=12, gradient_accumulation_steps=2, dist_timeout_s=60)


class Lighthouse:
    """torchft_lighthouse in a process of its own, as a user starts it; address() as torchft's
    in-process LighthouseServer has it."""

    def __init__(self, log, **flags):
        binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
        with open(log, "w") as f:
            self.proc = subprocess.Popen([binary, "--bind=[::]:0", *(f"--{k}={v}" for k, v in flags.items())],
                                         stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (found := re.search(r"listening on: (\S+)", open(log).read())):
            assert time.monotonic() < deadline and self.proc.poll() is None, open(log).read()
            time.sleep(0.05)
        self.url = found.group(1)

    def address(self):
        return self.url

    def shutdown(self):
        self.proc.kill()
        self.proc.wait()


def start(args, log):
    """A process whose output goes to the file `log` (torchft's Rust side logs every quorum: a pipe
    nobody reads while it runs would fill and stop it)."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
    proc.log = log
    return proc


def finish(proc, timeout=120, expect=0):
    """The process's output, once it exited with `expect` within `timeout` seconds."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"still running after {timeout} s: a group is waiting for ever")
    output = open(proc.log).read()
    assert proc.returncode == expect, output[-3000:]
    return output


def group(char_data, out, g, lighthouse, log, **extra):
    keys = {**COMMON, "ft_replica_group": g, "ft_groups": 2, "ft_lighthouse": lighthouse, **extra}
    return start([REPO / "train.py", *tiny_args(char_data, out, **keys)], log)


def steps(out_dir):
    return {r["iter"]: r for r in read_metrics(out_dir) if "loss" in r}


def test_two_groups_train_like_two_rank_ddp_and_resume_exactly_after_a_full_stop(char_data, tmp_path):
    """No failure: the lighthouse waits for both groups (min_replicas=2), every step averages
    both, and the mean of the two groups' losses is DDP's loss at every step. Then the same two
    groups stopped at step 12 (every group gone) and started again with init_from=auto take
    steps 12-23 exactly as the run that never stopped."""
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", min_replicas=2)
    both = lambda out, log, **keys: [group(char_data, out, g, lighthouse.address(), tmp_path / f"{log}{g}.log", **keys)
                                     for g in range(2)]
    try:
        groups = both(tmp_path / "ft", "group")
        ddp = start(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", REPO / "train.py",
                     *tiny_args(char_data, tmp_path / "ddp", **COMMON)], tmp_path / "ddp.log")
        for proc in [*groups, ddp]:
            finish(proc)
        for max_iters in (12, 24):
            for proc in both(tmp_path / "stopped", f"stopped{max_iters}_", max_iters=max_iters, init_from="auto"):
                finish(proc)
    finally:
        lighthouse.shutdown()
    for g in range(2):
        straight, stopped = steps(tmp_path / "ft" / f"group{g}"), steps(tmp_path / "stopped" / f"group{g}")
        assert sorted(stopped) == list(range(24)) and all(stopped[i]["loss"] == straight[i]["loss"] for i in range(24))
        a, b = (checkpoint.load(str(tmp_path / d / f"group{g}" / "ckpt.pt")) for d in ("ft", "stopped"))
        assert a["iter_num"] == b["iter_num"] == 24 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    ref = steps(tmp_path / "ddp")
    mine = [steps(tmp_path / "ft" / f"group{g}") for g in range(2)]
    assert sorted(ref) == sorted(mine[0]) == sorted(mine[1]) == list(range(24))
    assert all(m[i]["groups"] == 2 for m in mine for i in ref)
    # every step all-reduces the gradients: one float32 per parameter (test_diloco: once every sync_every steps)
    model_args = checkpoint.load(str(tmp_path / "ft" / "group0" / "ckpt.pt"))["model_args"]
    size = sum(p.nbytes for p in GPT(GPTConfig(**model_args)).parameters())
    assert all(m[i]["sync_bytes"] == size for m in mine for i in ref)
    # float32; the groups average their gradients over gloo as DDP does, in another reduction order at most
    assert max(abs((mine[0][i]["loss"] + mine[1][i]["loss"]) / 2 - ref[i]["loss"]) for i in ref) < 1e-5
    a, b = (checkpoint.load(str(tmp_path / "ft" / f"group{g}" / "ckpt.pt"))["model"] for g in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the replicas stay equal


def test_torchrun_groups_of_two_ranks_train_like_four_rank_ddp(char_data, tmp_path):
    """Each group a torchrun job of 2 ranks (DDP inside): rank r averages with its group, then
    with rank r of the other group, so the loss each group logs (its ranks' mean) averaged over
    the groups is 4-rank DDP's at every step."""
    keys = {**COMMON, "gradient_accumulation_steps": 4, "max_iters": 8, "lr_decay_iters": 8, "eval_interval": 8}
    torchrun = lambda n: ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", REPO / "train.py"]
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", min_replicas=2)
    try:
        groups = [start([*torchrun(2), *tiny_args(char_data, tmp_path / "ft", ft_replica_group=g, ft_groups=2,
                                               ft_lighthouse=lighthouse.address(), **keys)], tmp_path / f"group{g}.log")
                  for g in range(2)]
        ddp = start([*torchrun(4), *tiny_args(char_data, tmp_path / "ddp", **keys)], tmp_path / "ddp.log")
        for proc in [*groups, ddp]:
            finish(proc, timeout=180)
    finally:
        lighthouse.shutdown()
    ref = steps(tmp_path / "ddp")
    mine = [steps(tmp_path / "ft" / f"group{g}") for g in range(2)]
    assert sorted(ref) == sorted(mine[0]) == sorted(mine[1]) == list(range(8))
    model_args = checkpoint.load(str(tmp_path / "ft" / "group0" / "ckpt.pt"))["model_args"]
    size = sum(p.nbytes for p in GPT(GPTConfig(**model_args)).parameters())
    assert all(m[i]["groups"] == 2 and m[i]["sync_bytes"] == 2 * size for m in mine for i in ref)  # both ranks send
    assert max(abs((mine[0][i]["loss"] + mine[1][i]["loss"]) / 2 - ref[i]["loss"]) for i in ref) < 1e-5
    a, b = (checkpoint.load(str(tmp_path / "ft" / f"group{g}" / "ckpt.pt"))["model"] for g in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("sync_every", [0, 4], ids=["every-step", "diloco"])
def test_a_killed_group_restarts_and_heals_to_the_survivors_weights(char_data, tmp_path, sync_every):
    """Group 1 is SIGKILLed once both groups step together, and started again once group 0 has
    stepped alone; the restarted group heals from it (torchft logs it) at its first step, or with
    DiLoCo at its first sync, and jumps to the survivor's step. Both checkpoint every 48 steps
    (a sync step of DiLoCo's 4): at the first both write after the heal, their weights and
    optimizer states are equal bit for bit (with DiLoCo: the weights and the outer state; each
    group's inner optimizer keeps moments of its own data). SIGTERM then stops both there
    (scripts/ft_trials.py runs such kills to the end of the run, 10 times)."""
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", min_replicas=1, join_timeout_ms=1000)
    out = tmp_path / "ft"
    extra = dict(max_iters=100_000, lr_decay_iters=2000, eval_interval=48, always_save_checkpoint=True, keep_last=1000,
                 init_from="auto", sync_every=sync_every, dist_timeout_s=30)
    ckpts = lambda g: {int(p.stem[5:]) for p in (out / f"group{g}").glob("ckpt_[0-9]*.pt")}
    deadline = time.monotonic() + 200
    try:
        survivor = group(char_data, out, 0, lighthouse.address(), tmp_path / "survivor.log", **extra)
        victim = group(char_data, out, 1, lighthouse.address(), tmp_path / "victim.log", **extra)
        until = lambda done, *procs: wait_for(done, deadline, *procs)
        # both in a step's all-reduce (with DiLoCo: past two syncs of both)
        until(lambda: any(r.get("groups") == 2 and i >= 2 * sync_every for i, r in steps_or_empty(out / "group1").items()),
              victim, survivor)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        killed_at = max(steps_or_empty(out / "group0"), default=-1)
        # torchrun would start the group again at once; here it waits until the survivor has
        # stepped alone, which is the point, however slow this machine is
        until(lambda: any(i > killed_at and r["groups"] == 1 for i, r in steps_or_empty(out / "group0").items()), survivor)
        before = ckpts(1)  # the victim's own
        restarted = group(char_data, out, 1, lighthouse.address(), tmp_path / "restarted.log", **extra)
        until(lambda: any(n > killed_at for n in (ckpts(1) - before) & ckpts(0)), survivor, restarted)
        for proc in (survivor, restarted):
            os.killpg(proc.pid, signal.SIGTERM)
        output = finish(restarted, expect=75)
        finish(survivor, expect=75)
    finally:
        lighthouse.shutdown()
    alone = [i for i, r in steps(out / "group0").items() if i > killed_at and r["groups"] == 1]
    assert alone, "the survivor did not step on alone"
    assert "healing is required" in output  # torchft's log: the restarted group took the survivor's state
    its = sorted(r["iter"] for r in read_metrics(out / "group1") if "loss" in r and r["iter"] > min(alone))
    assert its and its[0] > max(alone) - 48, its[:5]  # it went on from the survivor's step, not from its own
    shared = min(n for n in (ckpts(1) - before) & ckpts(0) if n > killed_at)
    a, b = (checkpoint.load(str(out / f"group{g}" / f"ckpt_{shared:07d}.pt")) for g in range(2))
    assert a["iter_num"] == b["iter_num"] == shared
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    tensors = lambda state: [t for s in state["state"].values() for t in s.values() if torch.is_tensor(t)]
    if not sync_every:
        assert all(torch.equal(x, y) for x, y in zip(tensors(a["optimizer"]), tensors(b["optimizer"])))
    else:
        assert all(torch.equal(a["outer"]["last_sync"][k], b["outer"]["last_sync"][k]) for k in a["outer"]["last_sync"])
        assert all(torch.equal(x, y) for x, y in zip(tensors(a["outer"]["optimizer"]), tensors(b["outer"]["optimizer"])))


def wait_for(done, deadline, *procs):
    """Until done(), while every process in procs runs, or fail at the deadline with their logs' tails."""
    while not done():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail("\n".join(open(p.log).read()[-2000:] for p in procs))
        time.sleep(0.05)


def steps_or_empty(out_dir):
    try:
        return steps(out_dir)
    except (OSError, ValueError):
        return {}


def test_a_lighthouse_that_dies_stops_the_group_in_one_line(char_data, tmp_path):
    """The lighthouse SIGKILLed under a running group: its next quorum times out after
    dist_timeout_s, and train.py ends with one line that says what to do, not a traceback."""
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", min_replicas=1)
    try:
        proc = group(char_data, tmp_path / "ft", 0, lighthouse.address(), tmp_path / "group0.log",
                     max_iters=100_000, lr_decay_iters=100, dist_timeout_s=3)
        wait_for(lambda: len(steps_or_empty(tmp_path / "ft" / "group0")) > 2, time.monotonic() + 120, proc)
    finally:
        lighthouse.shutdown()
    output = finish(proc, expect=2)
    last = output.strip().splitlines()[-1]
    assert "Traceback" not in output and last.startswith("error: no quorum from the torchft lighthouse at "), last
    assert "within dist_timeout_s=3: is it running" in last


def test_the_process_group_is_nccl_in_a_child_on_cuda_and_gloo_on_the_cpu():
    from datetime import timedelta
    from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

    from gpt import replicas

    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        pg = replicas.process_group("cuda", timedelta(seconds=5))
    assert isinstance(pg, ProcessGroupBabyNCCL)
    assert isinstance(replicas.process_group("cpu", timedelta(seconds=5)), ProcessGroupGloo)


def test_replica_group_mistakes_are_one_line(char_data, tmp_path, monkeypatch):
    from conftest import run_script

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cases = {"no lighthouse is named": dict(gradient_accumulation_steps=2),
             "make it a multiple of ft_groups=2": dict(gradient_accumulation_steps=3)}
    for message, keys in cases.items():
        result = run_script("train.py", *tiny_args(char_data, tmp_path / "out", ft_replica_group=0, **keys))
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_without_torchft_training_runs_and_replica_groups_are_one_line(tmp_path):
    # torchft's wheels are Linux x86-64 only: on a Mac train.py must import, and a replica group must say why not
    script = "import runpy, sys; sys.modules['torchft'] = None; sys.argv[0] = 'train.py'; runpy.run_path('train.py', run_name='__main__')"
    args = [sys.executable, "-c", script, "--dataset=none", "--ft_replica_group=0", "--ft_groups=2",
            f"--out_dir={tmp_path / 'out'}", "--device=cpu"]
    out = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == ["error: ft_replica_group needs torchft, which is not installed here (its wheels "
                                               "are for Linux x86-64): pip install torchft on such a machine, or train "
                                               "without --ft_replica_group"]
