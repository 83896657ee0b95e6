"""Runs that survive: preemption signals, time budgets, non-finite steps, checkpoint rotation
and a full disk. Real processes, real signals. (That a run stopped by SIGTERM or kill -9 resumes
exactly: tests/test_recipes.py; that too many bad steps in a row stop the run with the last good
checkpoint: tests/test_step.py.)"""

import os
import signal

import pytest
import torch
from conftest import FULL_DISK, read_metrics, tiny_args
from processes import REPO, free_port, logged_steps, run_script, start_python, wait_for
from train_rank import nan_steps

from gpt.outdir import checkpoint

EXIT_STOPPED = 75
RANK_0_OF_2 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}  # torchrun's variables
ENDLESS = dict(max_iters=100_000, lr_decay_iters=100_000, eval_interval=100_000)  # a run that stops only when told


def test_time_budget_stops_with_a_checkpoint(char_data, tmp_path):
    out = tmp_path / "out"
    # 6 s: past step 0 even on a busy CPU
    result = run_script("train.py", *tiny_args(char_data, out, **ENDLESS, max_minutes=0.1))
    assert result.returncode == EXIT_STOPPED, result.stderr
    assert "(max_minutes)" in result.stdout
    assert checkpoint.load(str(out / "ckpt.pt"))["iter_num"] > 0


def test_a_non_finite_step_leaves_the_weights_alone(char_data, tmp_path, monkeypatch):
    """Step 5 is poisoned: the weights after steps 0-5 equal those after steps 0-4."""
    five = run_script("train.py", *tiny_args(char_data, tmp_path / "five", max_iters=5, eval_interval=1000))
    nan_steps(monkeypatch.setattr, {5})
    poisoned = run_script("train.py", *tiny_args(char_data, tmp_path / "six", max_iters=6, eval_interval=1000))
    assert five.returncode == 0 and poisoned.returncode == 0, poisoned.stderr
    assert (
        "iter 5: non-finite loss or gradient norm, 1 step(s) skipped since the last log (1 in a row)" in poisoned.stdout
    )
    a = checkpoint.load(str(tmp_path / "five" / "ckpt.pt"))
    b = checkpoint.load(str(tmp_path / "six" / "ckpt.pt"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(
        torch.equal(x, y) for x, y in zip(a["optimizer"]["state"][0].values(), b["optimizer"]["state"][0].values())
    )


@pytest.mark.process
def test_ddp_sigterm_to_the_launcher_stops_both_ranks_with_one_checkpoint(char_data, tmp_path):
    out = tmp_path / "out"
    args = tiny_args(char_data, out, gradient_accumulation_steps=2, **ENDLESS)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = start_python([*torchrun, REPO / "train.py", *args], env={"OMP_NUM_THREADS": "1"})
    wait_for(logged_steps(out / "metrics.jsonl", 3), proc, timeout=300)
    proc.send_signal(signal.SIGTERM)  # to torchrun, which passes it on to both ranks
    stdout, stderr = proc.communicate(timeout=300)  # no hang: both ranks agreed to stop
    assert "stopped at iter" in stdout, stderr[-2000:]
    assert stdout.count("stopped at iter") == 1  # printed by rank 0 only
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("ckpt")) == ["ckpt.pt"]
    state = checkpoint.load(str(out / "ckpt.pt"))
    assert state["iter_num"] >= 3 and len(state["rng"]["torch"]) == 2  # both ranks' RNG states inside


def test_keep_last_rotates_and_resume_takes_the_newest_complete(char_data, tmp_path):
    out = tmp_path / "out"
    keys = dict(max_iters=8, lr_decay_iters=8, eval_interval=2, keep_last=2)
    result = run_script("train.py", *tiny_args(char_data, out, **keys))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.glob("ckpt*.pt")) == [
        "ckpt.pt",
        "ckpt_0000006.pt",
        "ckpt_0000008.pt",
        "ckpt_best.pt",
    ]
    assert os.path.samefile(out / "ckpt.pt", out / "ckpt_0000008.pt")  # a link, not a second copy
    vals = {r["iter"]: r["val_loss"] for r in read_metrics(out) if "val_loss" in r and r["iter"] > 0}
    best = min(vals, key=vals.get)
    assert checkpoint.load(str(out / "ckpt_best.pt"))["iter_num"] == best  # kept apart from the rotation

    # the newest files are damaged (a copy cut short): resume falls back to the newest one that loads whole
    (out / "ckpt.pt").unlink()
    (out / "ckpt.pt").write_bytes(b"half a checkpoint")
    whole = (out / "ckpt_0000008.pt").read_bytes()
    (out / "ckpt_0000008.pt").write_bytes(whole[: len(whole) // 2])
    resumed = run_script("train.py", *tiny_args(char_data, out, **keys, init_from="resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout and "ckpt_0000006.pt (iter 6)" in resumed.stdout
    assert checkpoint.load(str(out / "ckpt.pt"))["iter_num"] == 8
    assert os.path.samefile(out / "ckpt.pt", out / "ckpt_0000008.pt")


def test_a_full_disk_stops_with_one_line_and_the_old_checkpoint(char_data, tiny_run_copy):
    if not FULL_DISK.exists():
        pytest.skip(f"no {FULL_DISK} here to make writes fail with ENOSPC")
    out = tiny_run_copy  # 30 steps; the resume's last step, 40, writes a checkpoint
    before = (out / "ckpt.pt").read_bytes()
    os.symlink(FULL_DISK, out / "ckpt.pt.tmp")  # the next checkpoint write hits a full disk
    result = run_script("train.py", *tiny_args(char_data, out, max_iters=40, lr_decay_iters=40, init_from="resume"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "No space left on device" in result.stderr
    assert (out / "ckpt.pt").read_bytes() == before and not os.path.lexists(out / "ckpt.pt.tmp")


@pytest.mark.process
def test_a_rank_whose_peer_never_comes_gives_up_after_dist_timeout_s(char_data, tmp_path):
    """Rank 0 of 2 alone (rank 1 never starts): it stops waiting at dist_timeout_s with one line,
    instead of hanging (torch's default wait is 30 minutes for gloo)."""
    port = free_port()  # for rank 0's store
    env = {**RANK_0_OF_2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    result = run_script(
        "train.py",
        *tiny_args(char_data, tmp_path / "out", gradient_accumulation_steps=2, dist_timeout_s=2),
        env=env,
        isolated=True,
    )
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: rank 0 of 2 gave up joining the process group at 127.0.0.1:{port} after dist_timeout_s=2")
    )


@pytest.mark.parametrize("shared", [True, False])
def test_restarts_with_torchruns_shared_store_get_a_note(monkeypatch, capsys, shared):
    """torchrun --max-restarts keeps one store for every attempt unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (then it tells the ranks TORCHELASTIC_USE_AGENT_STORE=False): rank 0 says how to launch instead."""
    from gpt.device import runtime

    env = {**RANK_0_OF_2, "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": str(shared)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(runtime.dist, "init_process_group", lambda **kwargs: None)  # no peers here
    monkeypatch.setattr(runtime.torch, "set_num_threads", lambda n: None)
    runtime.setup("cpu", "float32", "gloo", 5)
    assert ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().out) == shared
