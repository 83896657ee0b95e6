"""Evaluating while it trains (eval.py --watch=True, train.py's eval_async=True): each checkpoint scored
once, as eval.py scores it afterwards; watchers SIGKILLed, restarted, given up, stopped for a whole
run; checkpoints removed before or while read; a second watcher refused; TensorBoard and wandb.
train.py, eval.py and plot.py run in this process; the watchers are real processes."""

import json
import os
import random
import shlex
import shutil
import signal
import sys
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from conftest import bpe_eval_data, char_dataset, one_line_error, read_metrics, tiny_args
from processes import REPO, load_script, run_python, run_script, start_python, wait_for

from gpt.evaluation import watch
from gpt.outdir import checkpoint, metrics, ownership
from gpt.weights import load

TRAIN, EVAL, PLOT = (load_script(name) for name in ("train.py", "eval.py", "plot.py"))
ENV = {"OMP_NUM_THREADS": "1"}


def watch_records(out):
    return [r for r in read_metrics(out) if any(k.startswith("watch/") for k in r)]


def watcher_args(out):
    return ["--watch=True", f"--out_dir={out}", "--device=cpu", "--tasks=val", "--split_tokens=2048"]


def start_watcher(out, log):
    """`python eval.py --watch=True ...`, as a user starts it by hand; its output appended to `log` (proc.log)."""
    return start_python(["eval.py", *watcher_args(out)], log, env=ENV, append=True)


def holds_lock(out, pid):
    return f'"pid": {pid},' in _read(out / "watch.lock")


def _read(path):
    try:
        return path.read_text()
    except OSError:
        return ""


def iter_of(path):
    return checkpoint.load(path)["iter_num"] if os.path.isfile(path) else int(path.rsplit("_", 1)[1])


def keep_copies(monkeypatch, kept, then=None):
    """A copy of each checkpoint in `kept` as it becomes complete (keep_last removes them), then then(iter)."""
    committed = ownership.OutDir.committed

    def keeping(self, path):
        it = iter_of(path)
        copy = shutil.copyfile if os.path.isfile(path) else shutil.copytree
        copy(path, kept / f"ckpt_{it:07d}{'.pt' * os.path.isfile(path)}")
        committed(self, path)
        if then is not None:
            then(it)

    kept.mkdir()
    monkeypatch.setattr(ownership.OutDir, "committed", keeping)


def eval_json(capfd, *args):
    """`python eval.py ARGS --json=True` (its main, here): the results of its last line."""
    capfd.readouterr()
    assert EVAL.main([*map(str, args), "--json=True"]) == 0
    return json.loads(capfd.readouterr().out.strip().splitlines()[-1])


def one_record_each(out, saved, released=True):
    """({iter: record}, the skipped iters): every saved iteration has exactly one watcher record; with released,
    none is skipped but those training released."""
    records = watch_records(out)
    assert sorted(r["iter"] for r in records) == saved  # none missing, none twice
    records = {r["iter"]: r for r in records}
    skipped = sorted(i for i, r in records.items() if "watch/skipped" in r)
    if released:
        assert skipped == sorted(watch.released(str(out)))
        assert all(records[i]["watch/skipped"] == "released unscored (keep_unscored)" for i in skipped)
    return records, skipped


def kill(process):
    process.kill()
    assert process.wait() == -signal.SIGKILL, "the watcher ended before its kill"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return bpe_eval_data(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    return char_dataset(tmp_path_factory.mktemp("chars"))


@pytest.fixture(scope="module")
def finished_run(chars, tmp_path_factory):
    """A finished run with 10 checkpoints (iters 2, 4, ..., 20), all kept (tiny_run keeps one). Copy it to write."""
    out = tmp_path_factory.mktemp("finished") / "out"
    assert TRAIN.main(tiny_args(chars, out, max_iters=20, eval_interval=2, keep_last=100, log_interval=10)) == 0
    return out


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "out", symlinks=True)
    return tmp_path / "out"


# full: a BPE model, scored on val, test and HellaSwag; sharded: a character model (cheaper), on val
@pytest.mark.process
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_the_watcher_beside_a_run_scores_each_checkpoint_once_as_eval_py_does(
    fmt, bpe, chars, tmp_path, monkeypatch, capfd
):
    (data_dir, hs), bpe_tasks = (bpe, True) if fmt == "full" else ((chars, None), False)
    out, kept = tmp_path / "out", tmp_path / "kept"
    keep_copies(monkeypatch, kept)
    hellaswag = dict(hellaswag_interval=4, hellaswag_path=hs, hellaswag_examples=8) if bpe_tasks else {}
    keys = dict(checkpoint_format=fmt, eval_async=True, tensorboard_log=bpe_tasks, keep_last=2, **hellaswag)
    code = TRAIN.main(tiny_args(data_dir, out, block_size=32, max_iters=12, lr_decay_iters=12, eval_interval=4, **keys))
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr
    assert "Traceback" not in stdout + stderr
    assert (
        "watch: the run is over; 3 checkpoint(s) scored, 0 skipped; of the run's 3: 3 scored, 0 skipped, "
        "none without a record" in stdout
    )
    records = watch_records(out)
    assert [r["iter"] for r in records] == [4, 8, 12]  # every saved step once, in order
    assert sorted(os.listdir(kept)) == [f"ckpt_{i:07d}{'.pt' * (fmt == 'full')}" for i in (4, 8, 12)]
    assert not any("hellaswag_acc" in r for r in read_metrics(out))  # the loop ran no HellaSwag itself
    progress = {"scored": [4, 8, 12], "skipped": [], "seen": [], "scoring": None}
    assert json.loads((out / "watch.json").read_text()) == progress

    # eval.py afterwards, with the watcher's own command (as train.py printed it), on each kept copy
    line = next(line for line in stdout.splitlines() if line.startswith("eval_async:"))
    command = shlex.split(line.partition(": ")[2].partition(": ")[2])
    args = [a for a in command[2:] if a != "--watch=True"]
    assert f"--tasks={'val,test,hellaswag' if bpe_tasks else 'val'}" in args
    for r in records:
        copy = kept / f"ckpt_{r['iter']:07d}{'.pt' * (fmt == 'full')}"
        results = eval_json(capfd, *args, f"--checkpoint={copy}")
        expected = {f"watch/{k}": v for k, v in metrics.eval_record(results).items()}
        assert r == {"iter": r["iter"], **expected}  # every loss bitwise, every accuracy exactly
        hellaswag_keys = ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_acc_norm_chars")
        names = ("val_loss", "val_bpb") + bpe_tasks * ("test_loss", "test_bpb", *hellaswag_keys)
        assert set(expected) == {f"watch/{k}" for k in names}

    if bpe_tasks:
        PLOT.main([str(out)])  # the watcher's HellaSwag alone makes the HellaSwag panel
        assert int.from_bytes((out / "metrics.png").read_bytes()[16:20], "big") > 2000
        # TensorBoard, read back with its own reader: the same numbers at the training steps
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(out / "tensorboard" / "watch"))
        events.Reload()
        for key in ("watch/val_loss", "watch/hellaswag_acc"):
            scalars = events.Scalars(key)
            assert [e.step for e in scalars] == [4, 8, 12]
            assert [e.value for e in scalars] == pytest.approx([r[key] for r in records], rel=1e-6)  # stored as float32


@pytest.mark.process
def test_a_watcher_started_by_hand_beside_a_run_and_killed_three_times_leaves_one_record_per_checkpoint(
    chars, tmp_path, monkeypatch, capfd
):
    """issue 50's scenario (keep_last=2, no eval_async): killed at a seeded random moment after it recorded
    something, and started again three checkpoints later, so checkpoints are rotated while none runs.
    Every saved iteration ends with one record: scored, equal bitwise to eval.py afterwards, or released."""
    out, log, saved = tmp_path / "out", tmp_path / "watch.log", list(range(2, 25, 2))
    rng, lives, at_kill = random.Random(0), [], []
    kills = {4: 10, 12: 18, 20: 24}  # killed at the first checkpoint, started again at the second

    def beside(it):
        if it == 2 or it in kills.values():
            lives.append(start_watcher(out, log))
            wait_for(lambda: holds_lock(out, lives[-1].pid) and (out / "watch.json").exists(), lives[-1])
        elif it in kills:
            before = at_kill[-1] if at_kill else 0
            wait_for(lambda: len(watch_records(out)) > before, lives[-1])  # each life gets somewhere
            time.sleep(rng.uniform(0, 0.3))  # then anywhere
            kill(lives[-1])
            at_kill.append(len(watch_records(out)))

    keep_copies(monkeypatch, tmp_path / "kept", then=beside)
    args = tiny_args(chars, out, max_iters=24, lr_decay_iters=24, eval_interval=2, keep_last=2, log_interval=2)
    assert TRAIN.main(args) == 0
    assert lives[-1].wait(timeout=180) == 0, _read(log)  # the run is over: the last life scores what is left
    assert len(lives) == 4 and [p.returncode for p in lives] == [-9, -9, -9, 0]
    assert all(0 < n < len(saved) for n in at_kill), at_kill  # killed midway, not only before or after the work

    records, skipped = one_record_each(out, saved)
    scored = sorted(set(records) - set(skipped))
    progress = json.loads((out / "watch.json").read_text())
    assert (progress["scored"], progress["skipped"], progress["seen"]) == (scored, skipped, [])
    summary = _read(log).strip().splitlines()[-1]
    assert summary.startswith("watch: the run is over; ") and summary.endswith(
        f"of the run's 12: {len(scored)} scored, {len(skipped)} skipped, none without a record"
    )
    for it in scored:  # as eval.py scores the kept copy afterwards, bitwise
        copy = next((tmp_path / "kept").glob(f"ckpt_{it:07d}*"))
        results = eval_json(capfd, *[a for a in watcher_args(out) if a != "--watch=True"], f"--checkpoint={copy}")
        assert records[it] == {"iter": it, **{f"watch/{k}": v for k, v in metrics.eval_record(results).items()}}
    print(f"standalone: kills at {at_kill} records; {len(scored)} scored {scored}, {len(skipped)} skipped {skipped}")


def eval_async_run(chars, out, monkeypatch, capfd, kill_at, max_iters):
    """(eval_async lines, stdout, records at each kill) of train.py, its watcher killed at kill_at once it records."""
    children, at_kill = [], []

    class Child(watch.Child):  # the run's own, kept at hand to kill
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            children.append(self)

    def beside(self, path):
        committed(self, path)
        if iter_of(path) in kill_at:
            process, before = children[0].process, at_kill[-1] if at_kill else 0
            wait_for(lambda: holds_lock(out, process.pid) and len(watch_records(out)) > before)
            kill(process)
            at_kill.append(len(watch_records(out)))

    committed = ownership.OutDir.committed
    monkeypatch.setattr(watch, "Child", Child)
    monkeypatch.setattr(ownership.OutDir, "committed", beside)
    keys = dict(eval_interval=2, log_interval=2, keep_last=2, keep_unscored=2, eval_async=True)
    code = TRAIN.main(tiny_args(chars, out, max_iters=max_iters, lr_decay_iters=max_iters, **keys))
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr
    assert f"step {max_iters}: train loss" in stdout  # training went on to its end
    return [line for line in stdout.splitlines() if "eval_async:" in line], stdout, at_kill


@pytest.mark.process
def test_eval_async_starts_a_dead_watcher_again_and_every_checkpoint_ends_with_one_record(
    chars, tmp_path, monkeypatch, capfd
):
    """Killed at 4, 8 and 12: one line each, started again at once; the last scores what is left from its progress."""
    monkeypatch.setattr(watch, "RESTART_DELAYS_S", (0, 0, 0))
    out, saved = tmp_path / "out", list(range(2, 17, 2))
    lines, stdout, at_kill = eval_async_run(chars, out, monkeypatch, capfd, {4, 8, 12}, max_iters=16)
    died = [line for line in lines if line.startswith("warning: eval_async: the watcher (pid")]
    assert [line.partition(" (pid ")[2].partition(") ")[2] for line in died] == [
        f"was killed by SIGKILL (exit code -9); it starts again in 0 s (restart {n} of 3)" for n in (1, 2, 3)
    ]
    started = [line for line in lines if line.startswith("eval_async: the watcher started again (pid")]
    assert [line.partition(", ")[2] for line in started] == [
        f"restart {n} of 3); it goes on from its progress" for n in (1, 2, 3)
    ]
    _, skipped = one_record_each(out, saved)
    assert "none without a record" in stdout and not any("without a watcher record" in line for line in lines)
    print(f"eval_async restarted: kills at {at_kill} records; skipped {skipped}")


@pytest.mark.process
def test_eval_async_leaves_a_watcher_dead_after_its_restarts_training_goes_on_and_its_end_names_what_is_unscored(
    chars, tmp_path, monkeypatch, capfd
):
    """Killed again at 8, left dead with one line; training goes on, its last line names a command that fills in."""
    monkeypatch.setattr(watch, "RESTART_DELAYS_S", (0,))
    out, saved = tmp_path / "out", list(range(2, 13, 2))
    lines, stdout, at_kill = eval_async_run(chars, out, monkeypatch, capfd, {4, 8}, max_iters=12)
    died = [line for line in lines if line.startswith("warning: eval_async: the watcher (pid")]
    assert [line.partition("; ")[2] for line in died] == [
        "it starts again in 0 s (restart 1 of 1)",
        "no restart left (1 used): training goes on, and its end names the checkpoints left without a record",
    ]
    unscored = sorted(set(saved) - {r["iter"] for r in watch_records(out)})
    assert 10 in unscored and 12 in unscored  # saved after the last kill
    assert lines[-1].startswith(
        f"warning: eval_async: {len(unscored)} checkpoint(s) without a watcher record (iters "
        f"{', '.join(map(str, unscored))}): python {REPO / 'eval.py'} --watch=True"
    )
    command = shlex.split(lines[-1].partition("): ")[2].partition(" scores those")[0])
    assert EVAL.main(command[2:]) == 0  # the command the line names fills them in
    _, skipped = one_record_each(out, saved)
    assert "none without a record" in capfd.readouterr().out
    print(f"eval_async given up: kills at {at_kill} records; unscored at the end {unscored}; skipped {skipped}")


@pytest.mark.process
def test_a_dead_child_is_started_again_after_longer_and_longer_waits_then_left(tmp_path, monkeypatch):
    """Started again after each of RESTART_DELAYS_S, never sooner; then left, and finish() names what has no record."""
    monkeypatch.setattr(watch, "RESTART_DELAYS_S", (0.05, 0.1, 0.2))
    (tmp_path / "ckpt_0000010.pt").write_bytes(b"")  # a complete checkpoint nobody scored
    said = []
    say = lambda m: said.append((time.monotonic(), m))
    child = watch.Child([sys.executable, "-c", "raise SystemExit(3)"], str(tmp_path), say=say)
    deadline = time.monotonic() + 60
    while "no restart left" not in said[-1][1]:
        child.check()
        time.sleep(0.002)
        assert time.monotonic() < deadline, said
    kinds = ["died" if "exited with code 3" in m else "started" if "started again (pid" in m else m for _, m in said]
    assert kinds[1:] == ["died", "started"] * 3 + ["died"] and "scores each checkpoint" in kinds[0]
    died = [(t, m) for (t, m), kind in zip(said, kinds) if kind == "died"]
    started = [(t, m) for (t, m), kind in zip(said, kinds) if kind == "started"]
    assert [m.split("; ", 1)[1] for _, m in died[:3]] == [
        f"it starts again in {d:g} s (restart {n} of 3)" for n, d in enumerate(watch.RESTART_DELAYS_S, 1)
    ]
    assert len(died) == 4 and len(started) == 3 and "no restart left (3 used)" in died[3][1]
    for (t_died, _), (t_started, m), delay in zip(died, started, watch.RESTART_DELAYS_S):
        assert t_started - t_died >= delay, m  # never before its delay (said, then scheduled)
    before = len(said)
    child.check()  # left dead: nothing more
    assert len(said) == before
    child.finish()
    assert [m for _, m in said[before:]] == [
        "warning: eval_async: 1 checkpoint(s) without a watcher record (iters 10): python -c 'raise SystemExit(3)' "
        "scores those still on disk and logs the others as skipped"
    ]


@pytest.mark.process
def test_a_stopped_watcher_costs_at_most_keep_last_plus_keep_unscored_plus_one_checkpoints(
    chars, tmp_path, monkeypatch
):
    """SIGSTOPped for the whole run: never more than 5 checkpoints on disk (right after each save, before rotation);
    the older unscored ones released and, once it is continued, logged as skipped with one line each."""
    out, log, saved, on_disk, watcher = tmp_path / "out", tmp_path / "watch.log", list(range(2, 21, 2)), [], []
    write_config, save = ownership.OutDir.write_config, checkpoint.save

    def then_a_watcher(self, cfg):  # train.lock is held, no checkpoint yet
        write_config(self, cfg)
        watcher.append(start_watcher(out, log))
        wait_for(lambda: holds_lock(out, watcher[0].pid) and (out / "watch.json").exists(), watcher[0])
        watcher[0].send_signal(signal.SIGSTOP)

    def counted(state, path):
        save(state, path)
        on_disk.append(len(watch.complete_checkpoints(str(out))))

    monkeypatch.setattr(ownership.OutDir, "write_config", then_a_watcher)
    monkeypatch.setattr(checkpoint, "save", counted)
    try:
        keys = dict(eval_interval=2, keep_last=2, keep_unscored=2)
        assert TRAIN.main(tiny_args(chars, out, max_iters=20, lr_decay_iters=20, **keys)) == 0
        assert len(on_disk) == len(saved) and max(on_disk) == 2 + 2 + 1, on_disk
        assert sorted(watch.complete_checkpoints(str(out))) == [14, 16, 18, 20]  # keep_last 2, keep_unscored 2
        assert sorted(watch.released(str(out))) == list(range(2, 13, 2))
    finally:
        watcher[0].send_signal(signal.SIGCONT)
    assert watcher[0].wait(timeout=180) == 0, _read(log)
    records, skipped = one_record_each(out, saved)
    assert skipped == list(range(2, 13, 2))
    assert all("watch/val_loss" in records[i] for i in (14, 16, 18, 20))
    output = _read(log).splitlines()
    assert "note: iter 2's checkpoint was released by training before it was scored (keep_unscored); skipped" in output
    assert output[-1] == (
        "watch: the run is over; 4 checkpoint(s) scored, 6 skipped; of the run's 10: 4 scored, 6 skipped, "
        "none without a record"
    )
    print(f"disk: checkpoints on disk right after each save {on_disk}")


@pytest.mark.process
def test_retention_keeps_the_one_being_scored_then_the_newest_and_lists_the_others_once(tmp_path):
    out = str(tmp_path)
    retention = watch.Retention(out, hold=3)
    assert not retention.follows()  # no watcher: keep_last alone
    assert watch.Retention(out, hold=3, child=True).follows()  # eval_async's own, before it has started
    fd = ownership.lock_watcher(out)  # a watcher holds watch.lock (before its first progress)
    assert retention.follows()
    os.close(fd)
    finished = run_python(["-c", "import os; print(os.getpid())"])
    holder = json.loads((tmp_path / "watch.lock").read_text())
    (tmp_path / "watch.lock").write_text(json.dumps({**holder, "pid": int(finished.stdout)}))
    assert not retention.follows()  # the process that held it is gone
    checkpoint.write_json(
        os.path.join(out, "watch.json"), {"scored": [30], "skipped": [], "seen": [10, 20], "scoring": 10}
    )
    assert retention.follows()  # a watcher's progress: it follows even while dead or stopped
    doomed = [10, 20, 30, 40, 50, 60]
    assert retention(doomed) == {10, 60, 50}  # the one being scored, then the newest; 30 is scored
    assert sorted(watch.released(out)) == [20, 40]
    assert retention(doomed) == {10, 60, 50} and (tmp_path / "watch_released.jsonl").read_text().count("\n") == 2
    assert watch.Retention(out, hold=0)(doomed) == set()  # keep_unscored=0: not even the one being scored
    assert sorted(watch.released(out)) == [10, 20, 40, 50, 60]
    (tmp_path / "staged").mkdir()  # a new run over this one, before its first checkpoint: these are the old run's
    assert not retention.follows() and retention([70]) == set() and 70 not in watch.released(out)


def test_a_checkpoint_removed_before_or_while_it_is_read_gets_a_record_and_a_line(
    finished_run, tmp_path, monkeypatch, capsys
):
    """Iter 4's, which a watcher saw (watch.json's seen), removed by hand before it came back to it, and iter 8's,
    removed while it is read: neither released by training, both skipped with one line, never missing in silence."""
    out = copy_of(finished_run, tmp_path)
    checkpoint.write_json(str(out / "watch.json"), {"scored": [], "skipped": [], "seen": [2, 4], "scoring": None})
    os.remove(out / "ckpt_0000004.pt")
    for_inference = load.for_inference

    def removed_first(init_from, out_dir, which, report=print):
        if which == "ckpt_0000008.pt":
            os.remove(os.path.join(out_dir, which))
        return for_inference(init_from, out_dir, which, report)

    monkeypatch.setattr(load, "for_inference", removed_first)
    assert EVAL.main(["--watch=True", f"--out_dir={out}", "--device=cpu", "--tasks=val"]) == 0
    stdout = capsys.readouterr().out
    assert "note: iter 4's checkpoint was removed before it was scored (not by keep_unscored); skipped" in stdout
    assert [line for line in stdout.splitlines() if "ckpt_0000008.pt" in line] == [
        "note: ckpt_0000008.pt disappeared while it was read (training removed it); skipped"
    ]
    records, _ = one_record_each(out, list(range(2, 21, 2)), released=False)
    assert records[4] == {"iter": 4, "watch/skipped": "removed before it was scored"}
    assert list(records[8]) == ["iter", "watch/skipped"]
    assert stdout.strip().splitlines()[-1] == (
        "watch: the run is over; 8 checkpoint(s) scored, 2 skipped; of the run's 10: 8 scored, 2 skipped, "
        "none without a record"
    )


def test_a_resumed_run_keeps_the_watchers_records_and_a_second_watch_fills_in_the_new_ones(
    finished_run, chars, tmp_path, capsys
):
    out = copy_of(finished_run, tmp_path)
    assert EVAL.main(["--watch=True", f"--out_dir={out}", "--device=cpu", "--tasks=val"]) == 0
    assert "10 checkpoint(s) scored" in capsys.readouterr().out
    before = watch_records(out)
    resumed = tiny_args(chars, out, max_iters=24, lr_decay_iters=24, eval_interval=2, keep_last=100, init_from="resume")
    assert TRAIN.main(resumed) == 0
    assert watch_records(out) == before  # the resumed run's truncation of metrics.jsonl kept them
    assert EVAL.main(["--watch=True", f"--out_dir={out}", "--device=cpu", "--tasks=val"]) == 0
    assert "2 checkpoint(s) scored, 0 skipped; of the run's 12: 12 scored" in capsys.readouterr().out
    assert [r["iter"] for r in watch_records(out)] == list(range(2, 25, 2))


APPENDER = """
import sys
from gpt.outdir import metrics
print("ready", flush=True)
sys.stdin.readline()  # go: both write at once
for i in range(1000):
    metrics.append_record(sys.argv[1], {"iter": i, "watch/text": "w" * 8000})
"""


@pytest.mark.process
def test_the_trainers_and_the_watchers_appends_never_tear_or_interleave(tmp_path):
    log = metrics.MetricsLog(str(tmp_path), None, SimpleNamespace(wandb_log=False, tensorboard_log=False))
    other = start_python(["-c", APPENDER, tmp_path / "metrics.jsonl"], stdin=True)
    assert other.stdout.readline() == "ready\n"
    other.stdin.write("go\n")
    other.stdin.flush()
    for i in range(1000):  # lines of 8 kB, past what one write() to a pipe keeps whole
        log.write({"iter": i, "text": "t" * 8000})
    other.stdin.close()
    assert other.wait(timeout=60) == 0
    other.stdout.close()
    other.stderr.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # each line whole
    assert sorted(r["iter"] for r in records if "text" in r) == list(range(1000))
    assert sorted(r["iter"] for r in records if "watch/text" in r) == list(range(1000))
    assert all(set(r["text"]) == {"t"} for r in records if "text" in r)  # no line holds the other's bytes
    assert all(set(r["watch/text"]) == {"w"} for r in records if "watch/text" in r)


def test_a_second_watcher_is_refused_naming_the_first(finished_run, tmp_path):
    out = copy_of(finished_run, tmp_path)
    fd = ownership.lock_watcher(str(out))  # a separate open file: flock refuses this process's second one too
    try:
        result = run_script("eval.py", "--watch=True", f"--out_dir={out}", "--device=cpu")
    finally:
        os.close(fd)
    one_line_error(result, f"error: out_dir={out} is already watched by another watcher (pid {os.getpid()} on ")
    assert result.returncode == 2
    assert not (out / "watch.json").exists()


@pytest.mark.process
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_under_torchrun_rank_0_alone_starts_the_watcher_and_its_records_join_the_runs_wandb_run(chars, tmp_path, capfd):
    """One watcher, whose records equal eval.py's afterwards; with wandb (offline), in the run's wandb run."""
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:
        wandb_internal_pb2 = None
    out = tmp_path / "out"
    keys = dict(eval_interval=4, keep_last=2, gradient_accumulation_steps=2, backend="gloo", eval_async=True)
    args = tiny_args(chars, out, max_iters=8, lr_decay_iters=8, wandb_log=wandb_internal_pb2 is not None, **keys)
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    result = run_python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *args], env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("eval_async: the watcher (pid") == 1 and "already watched" not in result.stderr
    records = watch_records(out)
    assert [r["iter"] for r in records] == [4, 8]
    for r in records:  # as one process scores the same checkpoint afterwards
        which = [f"--out_dir={out}", f"--checkpoint=ckpt_{r['iter']:07d}.pt", "--device=cpu", "--tasks=val"]
        val = eval_json(capfd, *which, f"--split_tokens={2 * 4 * 16}")["val"]
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
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
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
    missing = tmp_path / "missing"
    cases = [
        ("eval.py", ["--watch=True", f"--out_dir={missing}"], f"out_dir={missing} does not exist"),
        ("eval.py", ["--watch=True", "--init_from=gpt2"], "--watch follows a training run: give its --out_dir"),
        ("eval.py", [f"--out_dir={tmp_path}", "--checkpoint=ckpt_0000099.pt"], "no checkpoint at"),
        ("train.py", ["--eval_async=True", "--keep_unscored=-1"], "keep_unscored=-1 must be >= 0"),
    ]
    for script, args, message in cases:
        result = run_script(script, "--device=cpu", *args)
        one_line_error(result, message)
        assert result.returncode == 2, args
