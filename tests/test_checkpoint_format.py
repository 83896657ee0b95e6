"""Sharded (torch.distributed.checkpoint) and asynchronous checkpoints: exact resume under FSDP,
resume on another world size, single-process readers, faults during a background write, and
one-line messages for damaged checkpoints.

The tests share three runs (the `runs` fixture) in two torchrun launches, sharded_split's also running
sharded_full_disk after it:
  sharded_straight   COMMON's run
  sharded_split      the straight run's out_dir as it stood at iter 10, resumed to 20 by a new launch
  sharded_full_disk  the straight run's checkpoint resumed on 2 ranks, its next write hitting a full disk (FULL_DISK)
"""

import os
import shutil
import signal
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from conftest import FULL_DISK, assert_same_run, char_dataset, read_metrics, tiny_args, untimed
from processes import REPO, rank_reports, run_script, start_python, succeeded, torchrun, wait_for

from configurator import UserError
from gpt.outdir import checkpoint

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)

EXIT_STOPPED = 75


# FSDP on 2 ranks, sharded + async, 20 steps (keep_last=4: iters 5, 10, 15 and 20 stay)
COMMON = dict(
    max_iters=20,
    lr_decay_iters=20,
    eval_interval=5,
    gradient_accumulation_steps=2,
    dropout=0.1,
    parallelism="fsdp",
    checkpoint_format="sharded",
    async_checkpoint=True,
    keep_last=4,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(root, the data, each run's ranks' reports, full_disk's exit codes): the module docstring's runs."""
    root = tmp_path_factory.mktemp("sharded")
    data = char_dataset(root / "chars")
    args = lambda name, **keys: tiny_args(data, root / name, **{**COMMON, **keys})
    succeeded(torchrun(root, "sharded_straight", args("sharded_straight")))
    # iter 10's checkpoint was written in the background while the straight run trained on
    at_10 = shutil.ignore_patterns("ckpt_0000015", "ckpt_0000020", "ckpt_best", "rank*")
    shutil.copytree(root / "sharded_straight", root / "sharded_split", symlinks=True, ignore=at_10)
    # the straight run's last checkpoint resumed on 2 ranks, its next write (iter 25) failing with ENOSPC
    shutil.copytree(
        root / "sharded_straight", root / "sharded_full_disk", symlinks=True, ignore=shutil.ignore_patterns("rank*")
    )
    (root / "sharded_full_disk" / "ckpt_0000025").mkdir()
    for rank in range(2):
        os.symlink(FULL_DISK, root / "sharded_full_disk" / "ckpt_0000025" / f"__{rank}_0.distcp")
    # in the split run's launch, after it (it fails)
    full_disk = args("sharded_full_disk", init_from="resume", max_iters=30, lr_decay_iters=30)
    then = [[str(root / "sharded_full_disk" / "rank"), {}, full_disk]]
    codes, _, _ = torchrun(root, "sharded_split", args("sharded_split", init_from="resume"), {"then": then})
    reports = {name: rank_reports(root / name) for name in ("sharded_straight", "sharded_split", "sharded_full_disk")}
    split = reports["sharded_split"]
    assert [r["exit"] for r in split] == [0, 0], "".join(r["stderr"][-3000:] for r in split)
    return root, data, reports, codes


@pytest.mark.process
def test_fsdp_sharded_async_resume_is_exact(runs):
    root, _, results, _ = runs
    assert untimed(root / "sharded_split") == untimed(root / "sharded_straight")  # loss for loss
    assert "resuming at iter 10" in results["sharded_split"][0]["stdout"]
    a, b = (checkpoint.read_sharded(str(root / run / "ckpt_0000020")) for run in ("sharded_straight", "sharded_split"))
    assert a["iter_num"] == b["iter_num"] == 20 and len(a["rng"]["torch"]) == 2
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(v[s], b["optimizer"]["state"][k][s]) for k, v in a["optimizer"]["state"].items() for s in v)
    # the split run resumed from iter 10's checkpoint, which was written in the background while the
    # straight run trained on: that every later loss and the final state are bit for bit the straight
    # run's shows the state was staged at the step boundary, before step 10 changed a weight


@pytest.mark.process
def test_a_sharded_checkpoint_is_a_directory_of_shards_committed_last(runs):
    root, _, _, _ = runs
    straight = root / "sharded_straight"
    names = sorted(p.name for p in straight.iterdir() if p.name.startswith("ckpt"))
    assert names == ["ckpt_0000005", "ckpt_0000010", "ckpt_0000015", "ckpt_0000020", "ckpt_best"]  # keep_last=4
    last = straight / "ckpt_0000020"
    assert sorted(os.listdir(last)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "checkpoint.json"]
    vals = {r["iter"]: r["val_loss"] for r in read_metrics(straight) if "val_loss" in r and r["iter"] > 0}
    assert os.readlink(straight / "ckpt_best") == f"ckpt_{min(vals, key=vals.get):07d}"


@pytest.mark.process
def test_the_sharded_checkpoint_resumes_on_one_rank_and_readers_need_no_process_group(runs, tmp_path):
    root, data, _, _ = runs
    out = tmp_path / "one"
    shutil.copytree(root / "sharded_split", out, symlinks=True)
    result = run_script("train.py", *tiny_args(data, out, **{**COMMON, "max_iters": 24, "init_from": "resume"}))
    assert result.returncode == 0, result.stderr
    assert "checkpoint was written by 2 rank(s), this run has 1: dropout RNG reseeded" in result.stdout
    straight = {r["iter"]: r["loss"] for r in read_metrics(root / "sharded_straight") if "loss" in r}
    resumed = {r["iter"]: r["loss"] for r in read_metrics(out) if "loss" in r and r["iter"] >= 20}
    assert sorted(resumed) == [20, 21, 22, 23]
    # the same weights and batch as the 2-rank run's iter 19, only other dropout masks
    assert resumed[20] == pytest.approx(straight[19], abs=0.3) and resumed[20] < straight[0] - 1.0
    assert (out / "ckpt_0000024" / "checkpoint.json").exists()

    model, _ = checkpoint.load_model(str(root / "sharded_split"), "latest", report=lambda m: None)
    whole = checkpoint.read_sharded(str(root / "sharded_split" / "ckpt_0000020"))
    assert all(torch.equal(v, whole["model"][k]) for k, v in model.state_dict().items())
    sample_flags = ["--device=cpu", "--num_samples=1", "--max_new_tokens=20", "--checkpoint=latest"]
    sample = run_script("sample.py", f"--out_dir={root / 'sharded_split'}", *sample_flags)
    assert sample.returncode == 0 and "ckpt_0000020 (iter 20" in sample.stdout + sample.stderr, sample.stderr

    converted = tmp_path / "converted.pt"  # the conversion command: the full format, as ckpt.pt is
    result = run_script("scripts/checkpoint_convert.py", root / "sharded_split" / "ckpt_0000020", converted)
    assert result.returncode == 0, result.stderr
    state = checkpoint.load(str(converted))
    assert all(torch.equal(state["model"][k], whole["model"][k]) for k in whole["model"])
    assert state["optimizer"]["param_groups"][0]["params"][0] == 0 and len(state["rng"]["torch"]) == 2


@pytest.mark.process
def test_a_failing_background_write_is_one_line_on_every_rank_and_keeps_the_last_checkpoint(runs):
    root, _, results, launch_exit = runs
    result = results["sharded_full_disk"]
    assert [r["exit"] for r in result] != [0, 0] and launch_exit != [0]
    errors = [line for r in result for line in r["stderr"].splitlines() if line.startswith("error:")]
    stderr = "".join(r["stderr"][-3000:] for r in result)
    assert errors and all("No space left on device" in e or "another rank" in e for e in errors), stderr
    # our part printed no traceback (a rank that torchrun ended once the other had failed may print no line)
    assert all("Traceback" not in r["stderr"].split("error:")[0] for r in result if "error:" in r["stderr"]), stderr
    assert not (root / "sharded_full_disk" / "ckpt_0000025" / "checkpoint.json").exists()
    assert checkpoint.read_sharded(str(root / "sharded_full_disk" / "ckpt_0000020"))["iter_num"] == 20


# A background write made slow: the real DCP write happens, but its future completes DELAY seconds
# later, as on a slow disk. The kill and the signal land while the save is in flight.
SLOW_DRIVER = textwrap.dedent("""
    import concurrent.futures, sys, threading, time
    sys.path.insert(0, {repo!r})
    import torch.distributed.checkpoint as dcp
    import configurator, train
    real, delay = dcp.async_save, float(sys.argv[1])

    def slow_async_save(state_dict, **kwargs):
        future = real(state_dict, **kwargs)
        if not str(kwargs["checkpoint_id"]).endswith("ckpt_0000010"):
            return future
        slow = concurrent.futures.Future()
        threading.Thread(target=lambda: (future.result(), time.sleep(delay), slow.set_result(None)), daemon=True).start()
        return slow

    dcp.async_save = slow_async_save
    configurator.run_main(lambda: train.main(sys.argv[2:]))
""")


def start_slow(tmp_path, delay, args):
    """train.py ARGS in a process of its own, its background write of iter 10 taking `delay` s longer."""
    driver = tmp_path / "slow.py"
    driver.write_text(SLOW_DRIVER.format(repo=str(REPO)))
    return start_python([driver, delay, *args])


def single(char_data, out, **overrides):
    args = {**COMMON, "parallelism": "ddp", "keep_last": 3, "max_iters": 400, "lr_decay_iters": 400, **overrides}
    return tiny_args(char_data, out, **args)


@pytest.mark.process
def test_kill_during_a_background_write_resumes_from_the_previous_complete_checkpoint(char_data, tmp_path):
    out = tmp_path / "out"
    proc = start_slow(tmp_path, 600, single(char_data, out))
    wait_for((out / "ckpt_0000010" / "__0_0.distcp").exists, proc)
    time.sleep(0.2)
    proc.kill()  # kill -9: the shards of iter 10 are on disk, its commit marker is not
    proc.communicate()
    assert not (out / "ckpt_0000010" / "checkpoint.json").exists()
    resumed = run_script("train.py", *single(char_data, out, max_iters=12, init_from="resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert "ckpt_0000010 is incomplete" in resumed.stdout
    assert "resuming from" in resumed.stdout and "ckpt_0000005 (iter 5)" in resumed.stdout
    assert checkpoint.read_sharded(str(out / "ckpt_0000012"))["iter_num"] == 12


@pytest.mark.process
def test_sigterm_while_a_save_is_in_flight_waits_for_it_and_exits_75(char_data, tmp_path):
    out = tmp_path / "out"
    proc = start_slow(tmp_path, 2, single(char_data, out))
    wait_for((out / "ckpt_0000010" / "__0_0.distcp").exists, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, stderr
    stopped_at = int(stdout.split("stopped at iter ")[1].split()[0])
    assert checkpoint.read_sharded(str(out / "ckpt_0000010"))["iter_num"] == 10  # the one in flight, completed
    # the stop comes at iter 10 itself when SIGTERM lands before that step's stop check, else later
    assert checkpoint.read_sharded(str(out / f"ckpt_{stopped_at:07d}"))["iter_num"] == stopped_at >= 10


def test_async_full_format_equals_the_synchronous_one(char_data, tmp_path):
    for asynchronous in (False, True):
        keys = dict(
            max_iters=20, lr_decay_iters=20, keep_last=4, checkpoint_format="auto", async_checkpoint=asynchronous
        )
        result = run_script("train.py", *single(char_data, tmp_path / str(asynchronous), **keys))
        assert result.returncode == 0, result.stderr
    for name in ("ckpt_0000010.pt", "ckpt.pt"):  # iter 10 was written while training went on
        assert_same_run(tmp_path / "True", tmp_path / "False", name)


@pytest.mark.parametrize("content", [b"junk", os.urandom(4096), "truncated"], ids=["junk", "random", "truncated"])
def test_a_damaged_checkpoint_is_one_line(tmp_path, content):
    path = tmp_path / "ckpt.pt"
    if content == "truncated":
        checkpoint.save({"model": {"w": torch.ones(100_000)}, "model_args": {}, "iter_num": 1}, str(path))
        content = path.read_bytes()[:200_000]
    path.write_bytes(content)
    with pytest.raises(
        UserError,
        match=r"ckpt.pt is damaged or not a checkpoint of this trainer \((not a PyTorch "
        r"file|cut short or corrupted)\); copy it again",
    ):
        checkpoint.load(str(path))


@pytest.mark.process
def test_a_sharded_directory_missing_a_shard_is_one_line(runs, tmp_path):
    root, data, _, _ = runs
    out = tmp_path / "out"
    shutil.copytree(root / "sharded_split", out, symlinks=True)
    (out / "ckpt_0000020" / "__1_0.distcp").unlink()
    result = run_script("sample.py", f"--out_dir={out}", "--device=cpu", "--checkpoint=latest")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {out / 'ckpt_0000020'} is missing its shard __1_0.distcp (every rank writes one); copy the whole "
        f"directory, or resume from an earlier checkpoint"
    ]


def test_unknown_checkpoint_format_is_one_line():
    result = run_script("train.py", "--checkpoint_format=zip")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: checkpoint_format='zip' is not one of 'auto', 'full', 'sharded'"
    ]
