"""A run is never lost to another run: gpt/outdir/ownership.py through train.py, sample.py and eval.py."""

import errno
import hashlib
import json
import os
import shutil
import socket

import pytest
import torch.distributed as dist
from conftest import CPU, char_dataset, one_line_error, read_metrics, tiny_args
from processes import REPO, logged_steps, run_python, run_script, start_python, wait_for

from configurator import TrainConfig, parse
from gpt.outdir import checkpoint, ownership

# 10 steps of a 20-step schedule; keep_last=2 leaves numbered checkpoints too, which a takeover must remove
BASE = dict(max_iters=10, lr_decay_iters=20, eval_interval=5, dropout=0.1, keep_last=2)


def contents(out_dir):
    found = {}
    for root, dirs, files in os.walk(out_dir):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, out_dir)
            if rel != ownership.LOCK:
                link = os.path.islink(path)
                found[rel] = "-> " + os.readlink(path) if link else hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def start(args):
    return start_python([REPO / "train.py", *args])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Not conftest's tiny_run: one format, without dropout, evaluated at steps 0 and 30 only."""
    root = tmp_path_factory.mktemp("outdir")
    data = char_dataset(root / "chars")
    for fmt in ("full", "sharded"):
        result = run_script("train.py", *tiny_args(data, root / fmt, **BASE, checkpoint_format=fmt))
        assert result.returncode == 0, result.stderr
    return root, data


def copy_of(base, fmt, tmp_path):
    root, data = base
    out = tmp_path / fmt
    shutil.copytree(root / fmt, out, symlinks=True)
    return out, data


# ---------------------------------------------------------------------------- a used out_dir


@pytest.mark.parametrize("fmt, init_from", [("full", "scratch"), ("sharded", "scratch"), ("full", "gpt2")])
def test_a_fresh_start_in_a_used_out_dir_refuses_and_changes_nothing(base, tmp_path, fmt, init_from):
    out, data = copy_of(base, fmt, tmp_path)
    before = contents(out)
    assert {"metrics.jsonl", "config.json"} <= set(before)
    best, best_iter = min((r["val_loss"], r["iter"]) for r in read_metrics(out) if "val_loss" in r and r["iter"] > 0)
    # gpt2: refused before any download
    result = run_script("train.py", *tiny_args(data, out, max_iters=4, init_from=init_from))
    line = one_line_error(result)
    assert result.returncode == 2
    newest = "ckpt.pt" if fmt == "full" else "ckpt_0000010"
    at_best = f"iter 10, val loss {best:.4f}, the run's best"
    before_best = f"iter 10; the run's best val loss before it: {best:.4f} at iter {best_iter}"
    val = at_best if best_iter == 10 else before_best
    assert f"out_dir={out} already holds a run ({val}, {newest})" in line
    assert all(option in line for option in ("--init_from=resume", "--overwrite=True", "--out_dir"))
    assert contents(out) == before  # checkpoints, metrics.jsonl, config.json: byte for byte


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_overwrite_replaces_the_old_run_at_the_new_ones_first_checkpoint(base, tmp_path, fmt):
    out, data = copy_of(base, fmt, tmp_path)
    # keep_last=2: the old run's newer ckpt_<iter>s must not push this run's first one out of the rotation
    keys = dict(max_iters=6, lr_decay_iters=6, eval_interval=3, keep_last=2, checkpoint_format=fmt, overwrite=True)
    result = run_script("train.py", *tiny_args(data, out, **keys))
    assert result.returncode == 0, result.stderr
    assert "until this run's first checkpoint, then this run replaces it" in result.stdout
    records = read_metrics(out)  # the new run's only: a new file, not the old one appended to
    assert [r["iter"] for r in records if "loss" in r] == list(range(6))
    assert [r["iter"] for r in records if "val_loss" in r] == [0, 3, 6]
    assert json.loads((out / "config.json").read_text())["max_iters"] == 6
    names = sorted(p.name for p in out.iterdir())  # the old ckpt_0000005 and ckpt_0000010 are gone, staged/ too
    ext, newest = (".pt", ["ckpt.pt"]) if fmt == "full" else ("", [])
    kept = [f"ckpt_0000003{ext}", f"ckpt_0000006{ext}", f"ckpt_best{ext}"]
    assert names == [*newest, *kept, "config.json", "metrics.jsonl", ownership.LOCK]
    if fmt == "full":
        assert checkpoint.load(str(out / "ckpt.pt"))["iter_num"] == 6
        assert checkpoint.load(str(out / "ckpt_best.pt"))["config"]["max_iters"] == 6
    else:
        assert checkpoint.read_sharded(str(out / "ckpt_best"))["config"]["max_iters"] == 6


def test_a_takeover_cut_short_after_the_first_checkpoint_is_finished_by_the_next_run(base, tmp_path):
    out, _ = copy_of(base, "full", tmp_path)
    cfg = parse(TrainConfig, [f"--out_dir={out}", "--overwrite=True"])
    claimed = ownership.claim(cfg, CPU, say=lambda m: None)
    assert claimed.staging and claimed.path("metrics.jsonl") == str(out / ownership.STAGED / "metrics.jsonl")
    claimed.write_config(cfg)
    with open(claimed.path("metrics.jsonl"), "a") as f:
        f.write(json.dumps({"iter": 0, "loss": 4.0}) + "\n")
    state = checkpoint.load(str(out / "ckpt.pt"))
    checkpoint.save({**state, "iter_num": 3}, str(out / "ckpt.pt"))  # its first checkpoint; then it died
    claimed.release()

    notes = []
    again = ownership.claim(parse(TrainConfig, [f"--out_dir={out}", "--init_from=auto"]), CPU, say=notes.append)
    again.release()
    assert notes[0].startswith(f"note: finished the takeover of out_dir={out}")
    assert (
        notes[1] == f"init_from='auto': resuming the run in out_dir={out} (iter 3; the run's best val loss "
        f"before it: {state['best_val_loss']:.4f} at iter {state['best_val_iter']}, ckpt.pt)"
    )
    assert again.cfg.init_from == "resume"
    assert sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "config.json", "metrics.jsonl", ownership.LOCK]
    assert read_metrics(out) == [{"iter": 0, "loss": 4.0}]


# ---------------------------------------------------------------------------- one live run


@pytest.mark.process
def test_a_live_run_refuses_a_second_one_by_name_lets_readers_in_and_kill_9_leaves_no_lock_and_the_old_run_intact(
    base, tmp_path
):
    """The live run takes the old one over (--overwrite=True) and is killed before its first checkpoint."""
    out, data = copy_of(base, "full", tmp_path)
    before = contents(out)
    proc = start(tiny_args(data, out, max_iters=100_000, lr_decay_iters=100_000, eval_interval=100_000, overwrite=True))
    lock = out / ownership.LOCK
    wait_for(lambda: f'"pid": {proc.pid}' in lock.read_text(), proc)
    wait_for(logged_steps(out / ownership.STAGED / "metrics.jsonl"), proc)  # training, its log still staged
    try:
        for init_from in ("resume", "auto", "scratch"):  # the requeued job, the same command, a typo
            result = run_script("train.py", *tiny_args(data, out, max_iters=4, init_from=init_from))
            line = one_line_error(result)
            assert result.returncode == 2
            holder = json.loads(lock.read_text())
            assert line == (
                f"error: out_dir={out} is in use by another run (pid {proc.pid} on {socket.gethostname()}, "
                f"started {holder['started']}); wait for that run to end (or stop it), or choose another --out_dir"
            )
        # readers take no lock
        sampled = run_script("sample.py", f"--out_dir={out}", "--device=cpu", "--num_samples=1", "--max_new_tokens=8")
        assert sampled.returncode == 0 and "loaded " in sampled.stdout + sampled.stderr, sampled.stderr
        evaluated = run_script(
            "eval.py", f"--out_dir={out}", "--device=cpu", "--tasks=val", "--split_tokens=256", "--json=True"
        )
        assert evaluated.returncode == 0, evaluated.stderr
        assert json.loads(evaluated.stdout.strip().splitlines()[-1])["val"]["loss"] > 0
        assert proc.poll() is None  # still training
    finally:
        proc.kill()  # kill -9: no chance to let go of the lock
        proc.communicate()
    assert {k: v for k, v in contents(out).items() if not k.startswith(ownership.STAGED)} == before

    resumed = run_script("train.py", *tiny_args(data, out, **{**BASE, "max_iters": 12}, init_from="resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"removed {out / ownership.STAGED}, left by a run that stopped before its first checkpoint" in resumed.stdout
    assert "resuming at iter 10" in resumed.stdout and not (out / ownership.STAGED).exists()
    assert [r["iter"] for r in read_metrics(out) if "loss" in r] == list(range(12))  # the old log, continued
    assert lock.read_text() == ""  # the resumed run took the lock, and at its end left it naming no holder


def test_a_filesystem_that_cannot_lock_is_said_not_hidden(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(ownership.fcntl, "flock", no_locks)
    notes = []
    claimed = ownership.claim(parse(TrainConfig, [f"--out_dir={tmp_path / 'out'}"]), CPU, say=notes.append)
    assert claimed.fd is None and claimed.cfg.init_from == "scratch"
    assert notes == [
        f"warning: cannot lock out_dir={tmp_path / 'out'} ({os.strerror(errno.ENOLCK)}): nothing keeps a "
        f"second run from writing there; start one run per out_dir"
    ]


def test_network_filesystems_are_recognized_from_the_mount_table(tmp_path):
    mounts, disk = tmp_path / "mounts", os.path.join("/dev", "sda1")  # the root filesystem on a local disk
    mounts.write_text(
        f"{disk} / ext4 rw 0 0\n"
        "server:/export /mnt/shared nfs4 rw,relatime 0 0\n"
        "lustre@tcp:/fs /mnt/shared/scratch\\040space lustre rw 0 0\n"
    )
    assert ownership.network_filesystem("/mnt/shared/runs/out", str(mounts)) == "nfs4"
    assert ownership.network_filesystem("/mnt/shared/scratch space/out", str(mounts)) == "lustre"
    assert ownership.network_filesystem("/mnt/sharedother/out", str(mounts)) is None  # a prefix, not the mount point
    assert ownership.network_filesystem("/home/me/out", str(mounts)) is None


# ---------------------------------------------------------------------------- init_from='auto'


def test_auto_starts_from_scratch_in_an_empty_out_dir_and_resumes_in_a_used_one(base, tmp_path):
    """train.py's runs under init_from='auto': test_recipes.py's test_kill_9_then_init_from_auto_resumes_exactly."""
    out, _ = copy_of(base, "full", tmp_path)
    fresh = tmp_path / "fresh"
    scratch = f"init_from='auto': no checkpoint in out_dir={fresh}, starting from scratch"
    resume = f"init_from='auto': resuming the run in out_dir={out} (iter 10"
    for out_dir, init_from, said in ((fresh, "scratch", scratch), (out, "resume", resume)):
        notes, cfg = [], parse(TrainConfig, [f"--out_dir={out_dir}", "--init_from=auto"])
        claimed = ownership.claim(cfg, CPU, say=notes.append)
        claimed.release()
        assert claimed.cfg.init_from == init_from and notes[0].startswith(said), notes


# ---------------------------------------------------------------------------- under torchrun


@pytest.mark.process
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_a_refused_start_under_torchrun_ends_every_rank(base, tmp_path):
    out, data = copy_of(base, "full", tmp_path)
    before = contents(out)
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    args = tiny_args(data, out, gradient_accumulation_steps=2)
    result = run_python([*launch, *args], env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, result.stderr[-3000:]
    assert all(f"out_dir={out} already holds a run (iter 10" in e for e in errors), result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split("error:")[0]
    assert contents(out) == before
