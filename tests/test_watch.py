"""Evaluating while it trains (gpt/watch.py, eval.py --watch=True, train.py's eval_async=True): each
checkpoint scored once, as eval.py scores it afterwards, in both formats; a watcher SIGKILLed and
restarted; one that falls behind (retention); one checkpoint removed while read; a second watcher
refused; the records in TensorBoard and wandb."""

import json
import os
import random
import shlex
import shutil
import signal
import threading
import time

import pytest
import torch.distributed as dist
from conftest import (
    REPO,
    bpe_eval_data,
    char_dataset,
    load_script,
    piped_python,
    read_metrics,
    run_python,
    run_script,
    tiny_args,
)

from gpt import checkpoint, load, outdir, watch


def watch_records(out):
    return [r for r in read_metrics(out) if any(k.startswith("watch/") for k in r)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(a GPT-2 BPE dataset with val and test, a HellaSwag-format file of 30 records)."""
    return bpe_eval_data(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    return char_dataset(tmp_path_factory.mktemp("chars"))


@pytest.fixture(scope="module")
def finished_run(chars, tmp_path_factory):
    """A finished character-level run with 10 checkpoints (iters 2, 4, ..., 20), all kept. Copy it to write there."""
    out = tmp_path_factory.mktemp("finished") / "out"
    result = run_script(
        "train.py", *tiny_args(chars, out, max_iters=20, eval_interval=2, keep_last=100, log_interval=10)
    )
    assert result.returncode == 0, result.stderr
    return out


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "out", symlinks=True)
    return tmp_path / "out"


# full: a BPE model, scored on val, test and HellaSwag; sharded: a character model (cheaper), on val
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_the_watcher_beside_a_run_scores_each_checkpoint_once_as_eval_py_does(
    fmt, bpe, chars, tmp_path, monkeypatch, forked_pythons
):
    (data_dir, hs), bpe_tasks = (bpe, True) if fmt == "full" else ((chars, None), False)
    out, kept = tmp_path / "out", tmp_path / "kept"
    kept.mkdir()
    committed = outdir.OutDir.committed

    def keeping(self, path):  # a copy of each checkpoint as it is complete: keep_last=2 removes them
        iter_num = checkpoint.load(path)["iter_num"] if os.path.isfile(path) else int(path.rsplit("_", 1)[1])
        (shutil.copyfile if os.path.isfile(path) else shutil.copytree)(
            path, kept / f"ckpt_{iter_num:07d}{'.pt' * os.path.isfile(path)}"
        )
        committed(self, path)

    monkeypatch.setattr(outdir.OutDir, "committed", keeping)
    hellaswag = dict(hellaswag_interval=4, hellaswag_path=hs, hellaswag_examples=8) if bpe_tasks else {}
    result = run_script(
        "train.py",
        *tiny_args(
            data_dir,
            out,
            block_size=32,
            max_iters=12,
            lr_decay_iters=12,
            eval_interval=4,
            keep_last=2,
            checkpoint_format=fmt,
            eval_async=True,
            tensorboard_log=bpe_tasks,
            **hellaswag,
        ),
        patched=True,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "watch: the run is over; 3 checkpoint(s) scored, 0 skipped" in result.stdout
    records = watch_records(out)
    assert [r["iter"] for r in records] == [4, 8, 12]  # every saved step once, in order
    assert sorted(os.listdir(kept)) == [f"ckpt_{i:07d}{'.pt' * (fmt == 'full')}" for i in (4, 8, 12)]
    assert not any("hellaswag_acc" in r for r in read_metrics(out))  # the loop ran no HellaSwag itself
    assert json.loads((out / "watch.json").read_text()) == {"scored": [4, 8, 12], "skipped": [], "scoring": None}

    # eval.py afterwards, with the watcher's own command (as train.py printed it), on each kept copy
    command = shlex.split(
        next(line for line in result.stdout.splitlines() if line.startswith("eval_async:"))
        .partition(": ")[2]
        .partition(": ")[2]
    )
    args = [a for a in command[2:] if a != "--watch=True"]
    assert f"--tasks={'val,test,hellaswag' if bpe_tasks else 'val'}" in args
    record = load_script("eval.py").record
    for r in records:
        copy = kept / f"ckpt_{r['iter']:07d}{'.pt' * (fmt == 'full')}"
        after = run_script("eval.py", *args, f"--checkpoint={copy}", "--json=True")
        assert after.returncode == 0, after.stderr
        expected = {f"watch/{k}": v for k, v in record(json.loads(after.stdout.strip().splitlines()[-1])).items()}
        assert r == {"iter": r["iter"], **expected}  # every loss bitwise, every accuracy exactly
        names = ("val_loss", "val_bpb") + bpe_tasks * (
            "test_loss",
            "test_bpb",
            "hellaswag_acc",
            "hellaswag_acc_norm",
            "hellaswag_acc_norm_chars",
        )
        assert set(expected) == {f"watch/{k}" for k in names}

    if bpe_tasks:
        plotted = run_script("plot.py", out)  # the watcher's HellaSwag alone makes the HellaSwag panel
        assert plotted.returncode == 0 and int.from_bytes((out / "metrics.png").read_bytes()[16:20], "big") > 2000
        # TensorBoard, read back with its own reader: the same numbers at the training steps
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard" / "watch"))
        events.Reload()
        for key in ("watch/val_loss", "watch/hellaswag_acc"):
            scalars = events.Scalars(key)
            assert [e.step for e in scalars] == [4, 8, 12]
            assert [e.value for e in scalars] == pytest.approx([r[key] for r in records], rel=1e-6)  # stored as float32


# Starts watchers fast: a process that has imported what eval.py imports (and run nothing on torch)
# forks one per "start" line, a real process running `python eval.py ARGS` from there on (output
# to LOG), and answers with its pid; "wait PID" answers with its exit status.
ZYGOTE = """
import os, runpy, sys
sys.path.insert(0, {repo!r})
os.chdir({repo!r})
import torch, torch.distributed.checkpoint
from gpt import core_eval, evaluation, load, runtime, tokenizer, watch
from gpt import tokens
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("wait"):
        print(os.waitpid(int(line.split()[1]), 0)[1], flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        log = os.open({log!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.argv = ["eval.py", *{args!r}]
        try:
            runpy.run_path("eval.py", run_name="__main__")
        except SystemExit as e:
            os._exit(e.code or 0)
        os._exit(1)
    print(pid, flush=True)
"""


def test_a_watcher_killed_at_random_moments_and_restarted_scores_each_checkpoint_once(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    args = ["--watch=True", f"--out_dir={out}", "--device=cpu", "--tasks=val", "--split_tokens=0"]
    zygote = piped_python(
        ["-c", ZYGOTE.format(repo=str(REPO), log=str(tmp_path / "log"), args=args)],
        tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    ask = lambda line: (zygote.stdin.write(line + "\n"), zygote.stdin.flush(), zygote.stdout.readline())[-1].strip()
    assert zygote.stdout.readline() == "ready\n"
    rng, kills, scored_at_kill = random.Random(0), 0, []
    try:
        while kills < 10:
            pid, deadline = int(ask("start")), time.time() + 120
            while f'"pid": {pid},' not in _read(out / "watch.lock") or len(watch_records(out)) < kills * 4 // 5:
                time.sleep(0.002)  # until it holds the lock and has scored some: each life gets somewhere
                assert time.time() < deadline, f"the watcher got stuck: {_read(tmp_path / 'log')}"
            time.sleep(
                rng.uniform(0, 0.05)
            )  # then anywhere: loading, scoring, appending a record, replacing watch.json
            os.kill(pid, signal.SIGKILL)
            status = int(ask(f"wait {pid}"))
            assert os.WIFSIGNALED(status), f"the watcher ended before its kill: {_read(tmp_path / 'log')}"
            kills += 1
            scored_at_kill.append(len(watch_records(out)))
        assert any(0 < n < 10 for n in scored_at_kill), (
            scored_at_kill
        )  # killed midway, not only before or after the work
        last = int(ask("start"))
        assert int(ask(f"wait {last}")) == 0, _read(tmp_path / "log")
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
    records = watch_records(out)
    assert sorted(r["iter"] for r in records) == list(range(2, 21, 2))  # none missing, none twice
    assert not any("watch/skipped" in r for r in records)
    assert json.loads((out / "watch.json").read_text())["scored"] == list(range(2, 21, 2))


def _read(path):
    try:
        return path.read_text()
    except OSError:
        return ""


class ThreadWatcher:
    """watch.Child's stand-in: the watcher in a thread of this process, with the test's scorer."""

    def __init__(self, out, score):
        self.thread = threading.Thread(target=lambda: self.counts.update(watch.follow(str(out), score, poll_s=0.05)))
        self.counts = {}
        self.thread.start()

    def finish(self):
        self.thread.join()


def test_a_watcher_that_falls_behind_holds_keep_unscored_checkpoints_and_skips_the_older_ones(
    chars, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    seen = {}

    def slow_score(path):
        """The first checkpoint takes until the run is over; the rest are quick."""
        it = int(os.path.basename(path)[5:12])
        if not seen:
            seen["first"] = it
            while watch.run_is_live(str(out)):
                time.sleep(0.05)
            seen["on_disk"] = sorted(
                watch.complete_checkpoints(str(out))
            )  # what training left: nothing more is removed
        return {"n": it}

    monkeypatch.setattr(watch, "Child", lambda command: ThreadWatcher(out, slow_score))
    result = run_script(
        "train.py",
        *tiny_args(chars, out, max_iters=20, eval_interval=2, keep_last=2, keep_unscored=3, eval_async=True),
        patched=True,
    )
    assert result.returncode == 0, result.stderr
    first, saved = seen["first"], list(range(2, 21, 2))
    # at the run's end: 18 and 20 (keep_last=2), the three newest unscored before them (keep_unscored=3), and the
    # one being scored all along; training never waited for it
    assert seen["on_disk"] == sorted({first, 12, 14, 16, 18, 20})
    records = {r["iter"]: r for r in watch_records(out)}
    assert sorted(records) == saved  # every saved step has one record: scored or skipped
    scored = sorted(i for i, r in records.items() if "watch/n" in r)
    skipped = sorted(i for i, r in records.items() if "watch/skipped" in r)
    assert scored == sorted({first, 12, 14, 16, 18, 20}), (scored, skipped)
    assert (
        skipped == [i for i in saved if i not in scored] and "released unscored" in records[skipped[0]]["watch/skipped"]
    )
    assert f"note: iter {skipped[0]}'s checkpoint was released by training before it was scored" in result.stdout


def test_a_checkpoint_removed_while_it_is_read_is_skipped_with_one_line(finished_run, tmp_path, monkeypatch):
    out = copy_of(finished_run, tmp_path)
    for_inference = load.for_inference

    def removed_first(init_from, out_dir, which, report=print):
        if which == "ckpt_0000004.pt":
            os.remove(os.path.join(out_dir, which))
        return for_inference(init_from, out_dir, which, report)

    monkeypatch.setattr(load, "for_inference", removed_first)
    result = run_script("eval.py", "--watch=True", f"--out_dir={out}", "--device=cpu", "--tasks=val", patched=True)
    assert result.returncode == 0 and "Traceback" not in result.stderr + result.stdout, result.stderr
    assert [line for line in result.stdout.splitlines() if "ckpt_0000004.pt" in line] == [
        "note: ckpt_0000004.pt disappeared while it was read (training removed it); skipped"
    ]
    records = {r["iter"]: r for r in watch_records(out)}
    assert sorted(records) == list(range(2, 21, 2)) and list(records[4]) == ["iter", "watch/skipped"]


def test_a_resumed_run_keeps_the_watchers_records_and_a_second_watch_fills_in_the_new_ones(
    finished_run, chars, tmp_path
):
    out = copy_of(finished_run, tmp_path)
    first = run_script("eval.py", "--watch=True", f"--out_dir={out}", "--device=cpu", "--tasks=val")
    assert first.returncode == 0 and "10 checkpoint(s) scored" in first.stdout, first.stderr
    before = watch_records(out)
    resumed = run_script(
        "train.py",
        *tiny_args(chars, out, max_iters=24, lr_decay_iters=24, eval_interval=2, keep_last=100, init_from="resume"),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert watch_records(out) == before  # the resumed run's truncation of metrics.jsonl kept them
    again = run_script("eval.py", "--watch=True", f"--out_dir={out}", "--device=cpu", "--tasks=val")
    assert again.returncode == 0 and "2 checkpoint(s) scored, 0 skipped" in again.stdout, again.stderr
    assert [r["iter"] for r in watch_records(out)] == list(range(2, 25, 2))


APPENDER = """
import sys
sys.path.insert(0, {repo!r})
from gpt import metrics
print("ready", flush=True)
sys.stdin.readline()  # go: both write at once
for i in range(1000):
    metrics.append_record({path!r}, {{"iter": i, "watch/text": "w" * 8000}})
"""


def test_the_trainers_and_the_watchers_appends_never_tear_or_interleave(tmp_path):
    from types import SimpleNamespace

    from gpt.metrics import MetricsLog

    log = MetricsLog(str(tmp_path), None, SimpleNamespace(wandb_log=False, tensorboard_log=False))
    other = piped_python(["-c", APPENDER.format(repo=str(REPO), path=str(tmp_path / "metrics.jsonl"))], tmp_path)
    assert other.stdout.readline() == "ready\n"
    other.stdin.write("go\n")
    other.stdin.flush()
    for i in range(1000):  # lines of 8 kB, past what one write() to a pipe keeps whole
        log.write({"iter": i, "text": "t" * 8000})
    assert other.wait(timeout=60) == 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # each line whole
    assert sorted(r["iter"] for r in records if "text" in r) == list(range(1000))
    assert sorted(r["iter"] for r in records if "watch/text" in r) == list(range(1000))
    assert all(
        set(r.get("text", r.get("watch/text"))) <= {"t", "w"} and len(set(r.get("text", r.get("watch/text")))) == 1
        for r in records
    )


def test_a_second_watcher_is_refused_naming_the_first(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    fd = outdir.lock_watcher(str(out))
    try:
        result = run_script("eval.py", "--watch=True", f"--out_dir={out}", "--device=cpu")
    finally:
        os.close(fd)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: out_dir={out} is already watched by another watcher (pid {os.getpid()} on ")
    assert not (out / "watch.json").exists()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_under_torchrun_rank_0_alone_starts_the_watcher_and_its_records_join_the_runs_wandb_run(chars, tmp_path):
    """Two gloo ranks with eval_async=True: one watcher, whose records equal eval.py's in one process
    afterwards; with wandb (offline) they are in the training run's wandb run, at the training steps."""
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:
        wandb_internal_pb2 = None
    out = tmp_path / "out"
    cmd = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        REPO / "train.py",
        *tiny_args(
            chars,
            out,
            max_iters=8,
            lr_decay_iters=8,
            eval_interval=4,
            keep_last=2,
            gradient_accumulation_steps=2,
            backend="gloo",
            eval_async=True,
            wandb_log=wandb_internal_pb2 is not None,
        ),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    result = run_python(cmd, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("eval_async: the watcher (pid") == 1 and "already watched" not in result.stderr
    records = watch_records(out)
    assert [r["iter"] for r in records] == [4, 8]
    for r in records:  # as one process scores the same checkpoint afterwards
        after = run_script(
            "eval.py",
            f"--out_dir={out}",
            f"--checkpoint=ckpt_{r['iter']:07d}.pt",
            "--device=cpu",
            "--tasks=val",
            f"--split_tokens={2 * 4 * 16}",
            "--json=True",
        )
        assert after.returncode == 0, after.stderr
        val = json.loads(after.stdout.strip().splitlines()[-1])["val"]
        assert (r["watch/val_loss"], r["watch/val_bpb"]) == (val["loss"], val["bpb"])

    if wandb_internal_pb2 is None:
        return
    run_id = checkpoint.load(str(out / "ckpt.pt"))["wandb_run_id"]
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2  # the trainer's and the watcher's, one wandb run
    logged = []
    for run in runs:
        for data in wandb_records(run / f"run-{run_id}.wandb"):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                if "watch/iter" in items:
                    logged.append(items)
    assert [(i["watch/iter"], i["watch/val_loss"]) for i in logged] == [
        (r["iter"], r["watch/val_loss"]) for r in records
    ]


def wandb_records(path, block=32768):
    """The protobuf records of a .wandb file: LevelDB's log format (blocks of 32 KiB; in each, chunks
    of a 7-byte header, crc32 uint32, length uint16, type uint8: 1 full, 2 first, 3 middle, 4 last)
    after wandb's own 7-byte header (':W&B', magic 0xBEE1, version)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            yield pending


def test_bad_input_is_one_line(tmp_path):
    cases = [
        (
            "eval.py",
            ["--watch=True", f"--out_dir={tmp_path / 'missing'}"],
            "out_dir=" + str(tmp_path / "missing") + " does not exist",
        ),
        ("eval.py", ["--watch=True", "--init_from=gpt2"], "--watch follows a training run: give its --out_dir"),
        ("eval.py", [f"--out_dir={tmp_path}", "--checkpoint=ckpt_0000099.pt"], "no checkpoint at"),
        ("train.py", ["--eval_async=True", "--keep_unscored=-1"], "keep_unscored=-1 must be >= 0"),
    ]
    for script, args, message in cases:
        result = run_script(script, "--device=cpu", *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], (args, result.stderr)
