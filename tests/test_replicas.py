"""Fault-tolerant replica groups (gpt/train/torchft_groups.py, torchft) against plain DDP, through a
full stop, a SIGKILLed group that heals bit for bit, and a lighthouse that dies."""

import os
import re
import shutil
import signal
import threading
import time
from unittest import mock

import pytest
import torch
from conftest import FT_COMMON, char_dataset, ft_parameter_bytes, needs, one_line_error, steps_by_iter, tiny_args
from processes import REPO, Lighthouse, finish, run_python, run_script, start_python, wait_for

from gpt.outdir import checkpoint

needs("torchft")
# torchft's lighthouse server (the torchft_lighthouse command's) runs in this process, but for the one that dies
from torchft.coordination import LighthouseServer


def start(args, log, stdin=False):
    """start_python with the output in the file `log`: torchft logs every quorum, and an unread pipe would fill."""
    return start_python(args, log, env={"OMP_NUM_THREADS": "1"}, stdin=stdin)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return char_dataset(tmp_path_factory.mktemp("chars"))


COMMON = dict(FT_COMMON, max_iters=12, lr_decay_iters=12, eval_interval=6)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """{name: out_dir} of the launches the every-step tests share, 12 steps of 4 micro-batches of 4 rows: groups (two
    of one rank), torchrun (two of 2 ranks), ddp (the reference, in this process: its 4 micro-batches average the 16
    rows of DDP's 2 ranks of 2, test_recipes.py's test_two_gloo_ranks_equal_one), resumed (groups, from step 6)."""
    root = tmp_path_factory.mktemp("replicas")
    launch = lambda n: ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", REPO / "train.py"]
    lighthouses, procs = [], []

    def pair(name, launcher, **keys):
        lighthouses.append(LighthouseServer(bind="[::]:0", min_replicas=2))
        ft = dict(COMMON, ft_groups=2, ft_lighthouse=lighthouses[-1].address(), **keys)
        for g in range(2):
            args = tiny_args(data, root / name, ft_replica_group=g, **ft)
            procs.append(start([*launcher, *args], root / f"{name}{g}.log"))
        return procs[-2:]

    try:
        pair("torchrun", launch(2))
        groups = pair("groups", [REPO / "train.py"])
        reference = run_script("train.py", *tiny_args(data, root / "ddp", **COMMON))
        assert reference.returncode == 0, reference.stderr
        for proc in groups:
            finish(proc, timeout=240)
        for g in range(2):
            (root / "resumed" / f"group{g}").mkdir(parents=True)
            shutil.copy(root / "groups" / f"group{g}" / "ckpt_0000006.pt", root / "resumed" / f"group{g}")
        pair("resumed", [REPO / "train.py"], init_from="auto")
        for proc in procs:
            finish(proc, timeout=240)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for server in lighthouses:
            server.shutdown()
    return {name: root / name for name in ("groups", "torchrun", "ddp", "resumed")}


def numbered_checkpoints(out, g):
    return {int(p.stem[5:]) for p in (out / f"group{g}").glob("ckpt_[0-9]*.pt")}


def equal_groups(out, name="ckpt.pt"):
    a, b = (checkpoint.load(str(out / f"group{g}" / name))["model"] for g in range(2))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.process
@pytest.mark.parametrize("name, ranks", [("groups", 1), ("torchrun", 2)], ids=["groups-of-1-rank", "torchrun-groups"])
def test_groups_train_like_ddp_of_all_their_ranks(runs, name, ranks):
    """The two groups stepped together at every one of DDP's steps, each rank of a group sending one
    float32 a parameter; the mean of their losses is DDP's, and their weights are equal at the end."""
    ref = steps_by_iter(runs["ddp"])
    mine = [steps_by_iter(runs[name] / f"group{g}") for g in range(2)]
    assert sorted(ref) == sorted(mine[0]) == sorted(mine[1]) == list(range(12))
    size = ft_parameter_bytes(runs[name])
    assert all(m[i]["groups"] == 2 and m[i]["sync_bytes"] == ranks * size for m in mine for i in ref)
    # float32; the groups average their gradients over gloo as DDP does, in another reduction order at most
    assert max(abs((mine[0][i]["loss"] + mine[1][i]["loss"]) / 2 - ref[i]["loss"]) for i in ref) < 1e-5
    assert ref[11]["loss"] < ref[0]["loss"] - 0.3  # and they learned
    assert equal_groups(runs[name])  # the replicas stay equal


@pytest.mark.process
def test_init_from_auto_after_a_full_stop_resumes_exactly(runs):
    """Started again on their step-6 checkpoints, with no group alive to heal from."""
    for g in range(2):
        straight, resumed = (steps_by_iter(runs[name] / f"group{g}") for name in ("groups", "resumed"))
        assert sorted(resumed) == list(range(6, 12))
        assert all(resumed[i]["loss"] == straight[i]["loss"] for i in resumed)
        a, b = (checkpoint.load(str(runs[name] / f"group{g}" / "ckpt.pt")) for name in ("groups", "resumed"))
        assert a["iter_num"] == b["iter_num"] == 12
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.process
def test_no_quorum_is_started_after_the_last_step(runs):
    """A quorum for step 12, which never comes, could be aborted as the process exits. A retried
    request asks again for the same step, so the steps are compared as a set."""
    for name, first in (("groups", 0), ("resumed", 6)):
        for g in range(2):
            log = (runs[name].parent / f"{name}{g}.log").read_text()
            own = rf'replica_id: "group{g}:[^"]*", address: "[^"]*", store_address: "[^"]*", step: (\d+)'
            lines = [line for line in log.splitlines() if "got lighthouse quorum" in line]
            quorums = {int(step) for line in lines for step in re.findall(own, line)}
            assert quorums == set(range(first, 12)), (name, g, sorted(quorums))


# the restarted group's interpreter, started with the others and let into train.py once the survivor has stepped
# alone: the seconds its imports take on a loaded machine are not seconds of the survivor stepping alone
RESTART = "import runpy, sys, torchft, train; sys.stdin.readline(); runpy.run_path('train.py', run_name='__main__')"


def kill_and_heal(data, tmp_path, sync_every):
    """Group 1 SIGKILLed once both step together, started again once group 0 has stepped alone, and
    both stopped by SIGTERM at their first shared checkpoint after the heal (every 8 steps: a sync
    step of DiLoCo's 4)."""
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    out = tmp_path / "ft"
    # dist_timeout_s: 6 times the lighthouse's 5 s to count a killed group out (the survivor's quorum waits
    # that long), room for a loaded machine
    extra = dict(max_iters=100_000, lr_decay_iters=2000, eval_interval=8, keep_last=1000, init_from="auto")
    extra.update(sync_every=sync_every, dist_timeout_s=30)
    ckpts, steps = (lambda g: numbered_checkpoints(out, g)), (lambda g: steps_or_empty(out / f"group{g}"))
    deadline = time.monotonic() + 200
    keys = {**FT_COMMON, "ft_groups": 2, "ft_lighthouse": server.address(), **extra}
    args, procs = (lambda g: tiny_args(data, out, ft_replica_group=g, **keys)), []
    try:
        for g, name in ((0, "survivor"), (1, "victim")):
            procs.append(start([REPO / "train.py", *args(g)], tmp_path / f"{name}.log"))
        procs.append(start(["-c", RESTART, *args(1)], tmp_path / "restarted.log", stdin=True))
        survivor, victim, restarted = procs
        until = lambda done, *alive: wait_for(done, *alive, timeout=deadline - time.monotonic())
        # both in a step's all-reduce (with DiLoCo: past two syncs of both)
        together = lambda: any(r.get("groups") == 2 and i >= 2 * sync_every for i, r in steps(1).items())
        until(together, victim, survivor, restarted)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        killed_at = max(steps(0), default=-1)
        # torchrun would start the group again at once; here it waits until the survivor has
        # stepped alone, which is the point, however slow this machine is
        alone = lambda: any(i > killed_at and r["groups"] == 1 for i, r in steps(0).items())
        until(alone, survivor, restarted)
        before = ckpts(1)  # the victim's own
        restarted.stdin.write("go\n")
        restarted.stdin.close()
        # their first shared checkpoint after the kill, and the restarted group's step at it logged
        # (a checkpoint is written before its step: a SIGTERM between the two left no row to read)
        shared = lambda: [n for n in (ckpts(1) - before) & ckpts(0) if n > killed_at]
        logged = lambda: shared() and any(i >= min(shared()) for i in steps(1))
        until(logged, survivor, restarted)
        for proc in (survivor, restarted):
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in (survivor, restarted):
            finish(proc, expect=75)
    finally:
        server.shutdown()
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return out, killed_at, before, restarted.log


@pytest.fixture(scope="module")
def killed(data, tmp_path_factory):
    """{sync_every: kill_and_heal's result, or its exception}, both at once in two threads: each
    mostly waits for the lighthouse, so together they take little more than one."""
    results = {}

    def run(sync_every):
        try:
            results[sync_every] = kill_and_heal(data, tmp_path_factory.mktemp(f"kill{sync_every}"), sync_every)
        except BaseException as e:  # pytest.fail's too: raised again by the test
            results[sync_every] = e

    threads = [threading.Thread(target=run, args=(sync_every,)) for sync_every in (0, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.process
@pytest.mark.parametrize("sync_every", [0, 4], ids=["every-step", "diloco"])
def test_a_killed_group_restarts_and_heals_to_the_survivors_weights(killed, sync_every):
    """With DiLoCo the weights and the outer state are equal: each inner optimizer keeps moments of its own data."""
    if isinstance(killed[sync_every], BaseException):
        raise killed[sync_every]
    out, killed_at, before, restarted_log = killed[sync_every]
    alone = [i for i, r in steps_by_iter(out / "group0").items() if i > killed_at and r["groups"] == 1]
    assert alone, "the survivor did not step on alone"
    # torchft's log: the restarted group took the survivor's state
    assert "healing is required" in open(restarted_log).read()
    its = sorted(i for i in steps_by_iter(out / "group1") if i > min(alone))
    assert its and its[0] > max(alone) - 16, its[:5]  # it went on from the survivor's step, not from its own
    shared = min(n for n in (numbered_checkpoints(out, 1) - before) & numbered_checkpoints(out, 0) if n > killed_at)
    a, b = (checkpoint.load(str(out / f"group{g}" / f"ckpt_{shared:07d}.pt")) for g in range(2))
    assert a["iter_num"] == b["iter_num"] == shared
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    tensors = lambda state: [t for s in state["state"].values() for t in s.values() if torch.is_tensor(t)]
    if not sync_every:
        assert all(torch.equal(x, y) for x, y in zip(tensors(a["optimizer"]), tensors(b["optimizer"])))
    else:
        assert all(torch.equal(a["outer"]["last_sync"][k], b["outer"]["last_sync"][k]) for k in a["outer"]["last_sync"])
        assert all(
            torch.equal(x, y) for x, y in zip(tensors(a["outer"]["optimizer"]), tensors(b["outer"]["optimizer"]))
        )


@pytest.mark.process
def test_a_lighthouse_that_dies_stops_the_group_in_one_line(data, tmp_path):
    lighthouse = Lighthouse(tmp_path / "lighthouse.log", min_replicas=1)
    try:
        keys = dict(FT_COMMON, max_iters=100_000, lr_decay_iters=100, dist_timeout_s=3, ft_groups=2)
        args = tiny_args(data, tmp_path / "ft", ft_replica_group=0, ft_lighthouse=lighthouse.address(), **keys)
        proc = start([REPO / "train.py", *args], tmp_path / "group0.log")
        wait_for(lambda: len(steps_or_empty(tmp_path / "ft" / "group0")) > 2, proc, timeout=120)
    finally:
        lighthouse.shutdown()
    output = finish(proc, expect=2)
    last = output.strip().splitlines()[-1]
    assert "Traceback" not in output and last.startswith("error: no quorum from the torchft lighthouse at "), last
    assert "within dist_timeout_s=3: is it running" in last


def steps_or_empty(out_dir):
    try:
        return steps_by_iter(out_dir)
    except (OSError, ValueError):
        return {}


def test_the_process_group_is_nccl_in_a_child_on_cuda_and_gloo_on_the_cpu():
    from datetime import timedelta

    from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

    from gpt.train import torchft_groups

    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        pg = torchft_groups.process_group("cuda", timedelta(seconds=5))
    assert isinstance(pg, ProcessGroupBabyNCCL)
    assert isinstance(torchft_groups.process_group("cpu", timedelta(seconds=5)), ProcessGroupGloo)


def test_replica_group_mistakes_are_one_line(data, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cases = {
        "no lighthouse is named": dict(gradient_accumulation_steps=2),
        "make it a multiple of ft_groups=2": dict(gradient_accumulation_steps=3),
    }
    for message, keys in cases.items():
        result = run_script("train.py", *tiny_args(data, tmp_path / "out", ft_replica_group=0, **keys))
        one_line_error(result, message)


@pytest.mark.process
def test_without_torchft_training_runs_never_importing_it_and_replica_groups_are_one_line(data, tmp_path):
    # torchft's wheels are Linux x86-64 only, it takes a second to import, and only replica groups need it (Alone in
    # replicas.py stands in): in a fresh interpreter, a run without groups, then torchft unimportable (a Mac), a group
    script = (
        "import runpy, sys, train; cut = sys.argv.index('--'); assert train.main(sys.argv[1:cut]) == 0; "
        "assert 'torchft' not in sys.modules, 'torchft imported'; sys.modules['torchft'] = None; "
        "sys.argv = ['train.py', *sys.argv[cut + 1 :]]; runpy.run_path('train.py', run_name='__main__')"
    )
    ft = ["--dataset=none", "--ft_replica_group=0", "--ft_groups=2", f"--out_dir={tmp_path / 'out'}", "--device=cpu"]
    result = run_python(["-c", script, *tiny_args(data, tmp_path / "plain", max_iters=2), "--", *ft])
    assert one_line_error(result) == (
        "error: ft_replica_group needs torchft, which is not installed here (its wheels are for Linux x86-64): "
        "pip install torchft on such a machine, or train without --ft_replica_group"
    )
    assert (tmp_path / "plain" / "ckpt.pt").exists()  # the run without replica groups trained to its end
