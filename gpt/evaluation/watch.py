"""Scoring a run's checkpoints as they land, without pausing it: the watcher behind
`python eval.py --watch=True`, which train.py's eval_async=True starts beside the run. The scoring
itself is the caller's (eval.py's tasks): follow() takes it as a function of a checkpoint's path.

  what         each complete checkpoint once, oldest first: ckpt_<iter>.pt (written whole, then
               renamed into place) and ckpt_<iter>/ once its checkpoint.json is there. ckpt.pt
               alone (keep_last=1 and no watcher following) is scored once the run has ended.
  the records  one line per checkpoint in out_dir/metrics.jsonl, {"iter": N, "watch/<name>": ...},
               each line one write() in append mode, as the trainer's: no line is torn or
               interleaved (gpt/outdir/metrics.py). Also TensorBoard (out_dir/tensorboard/watch) and the
               run's wandb run. A checkpoint gone before it was scored gets a record too: skipped.
  progress     out_dir/watch.json, replaced atomically: the iters scored and skipped, those seen
               and not yet done, and the one being scored. Written as the watcher starts, so it
               tells training a watcher follows the run. A restart also reads the records (a kill
               can fall between a record and the progress), so none is scored twice and none is skipped.
  one at once  out_dir/watch.lock (gpt/outdir/ownership.py): a second watcher is refused, naming the first.
  the end      once the run is over (train.lock names no live process: the run released it, or
               died) and every complete checkpoint is done; the summary names any checkpoint
               iteration left without a record.
  retention    while a watcher follows the run (train.py's eval_async child, one holding watch.lock,
               or one whose watch.json is there), train.py's checkpoint rotation asks Retention
               which of the checkpoints past keep_last to keep: the unscored ones, keep_unscored at
               most (the one being scored and the newest). Older unscored ones are listed in
               out_dir/watch_released.jsonl, then removed, and the watcher logs them as skipped.
               Training never waits for it.
  restarts     train.py checks its eval_async child between steps (Child.check, a poll()) and
               starts a dead one again, len(RESTART_DELAYS_S) times at most, each after a longer wait.
"""

import glob
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

from configurator import UserError
from gpt.outdir import checkpoint, metrics, ownership

PREFIX = "watch/"  # the watcher's names in metrics.jsonl, TensorBoard and wandb
PROGRESS, RELEASED = ownership.WATCH_FILES  # watch.json, watch_released.jsonl
EVAL_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "eval.py")
NUMBERED = re.compile(r"ckpt_(\d+)(\.pt)?")
RESTART_DELAYS_S = (10, 60, 300)  # a dead eval_async watcher is started again after each wait; after the last, not
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def complete_checkpoints(out_dir):
    """{iter: path} of the numbered checkpoints in out_dir that are whole."""
    found = {}
    for name in os.listdir(out_dir):
        m = NUMBERED.fullmatch(name)
        if m and is_complete(os.path.join(out_dir, name)):
            found[int(m.group(1))] = os.path.join(out_dir, name)
    return found


def is_complete(path):
    """A ckpt_<iter>.pt that is there (renamed into place whole), or a directory with its commit marker."""
    return os.path.isfile(os.path.join(path, checkpoint.COMMIT) if os.path.isdir(path) else path)


def run_is_live(out_dir):
    """True while a training run holds out_dir (train.lock; a run that releases it empties the file)."""
    return holder_is_alive(os.path.join(out_dir, ownership.LOCK))


def holder_is_alive(path):
    """True while the lock file at `path` (ownership.py's train.lock or watch.lock) names a process,
    and on this host one that is alive: one killed leaves its pid, one that ends empties the file."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return False
    if holder.get("host") != socket.gethostname():
        return True  # no way to ask another machine: until it empties the file
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


# ---------------------------------------------------------------------------- progress


def read_progress(out_dir):
    """{'scored': [iter, ...], 'skipped': [...], 'seen': [...], 'scoring': iter or None} from watch.json."""
    try:
        with open(os.path.join(out_dir, PROGRESS)) as f:
            progress = json.load(f)
    except (OSError, ValueError):
        progress = {}
    return {
        "scored": progress.get("scored", []),
        "skipped": progress.get("skipped", []),
        "seen": progress.get("seen", []),
        "scoring": progress.get("scoring"),
    }


def logged(out_dir):
    """{iter: 'scored' or 'skipped'} by the watcher's records in metrics.jsonl."""
    done = {}
    try:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            lines = f.readlines()
    except OSError:
        return done
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line being written as we read
            continue
        if any(key.startswith(PREFIX) for key in record):
            done[record["iter"]] = "skipped" if PREFIX + "skipped" in record else "scored"
    return done


def released(out_dir):
    """The iters training removed before the watcher scored them (watch_released.jsonl)."""
    try:
        with open(os.path.join(out_dir, RELEASED)) as f:
            return {json.loads(line)["iter"] for line in f if line.endswith("\n")}
    except OSError:
        return set()


def without_record(out_dir):
    """The iters of the run's checkpoints that no watcher record in metrics.jsonl names: those
    complete on disk, those training released, and those a watcher saw (watch.json)."""
    known = complete_checkpoints(out_dir).keys() | released(out_dir) | set(read_progress(out_dir)["seen"])
    return sorted(known - logged(out_dir).keys())


def staging(out_dir):
    """True while a new run over an old one has not taken out_dir over (ownership.py): until then the
    checkpoints and the watcher's files there are the old run's."""
    return os.path.isdir(os.path.join(out_dir, ownership.STAGED))


class Retention:
    """saver.Checkpointer's spare, asked at each rotation. follows(): does a watcher follow the run
    now? Called with the checkpoints rotation would remove (doomed, iters): keep those the watcher
    has not done, `hold` at most: the one it is scoring, then the newest. The others are listed in
    watch_released.jsonl before they are removed."""

    def __init__(self, out_dir, hold, child=False):
        self.out_dir, self.hold, self.child = out_dir, hold, child  # child: train.py's eval_async watcher

    def follows(self):
        """The run's own watcher (eval_async), one that holds watch.lock now, or one that has left
        its progress here: file checks only, at each save, since a watcher can be started mid-run."""
        if self.child:
            return True
        if staging(self.out_dir):
            return False  # those files are the old run's
        return os.path.isfile(os.path.join(self.out_dir, PROGRESS)) or holder_is_alive(
            os.path.join(self.out_dir, ownership.WATCH_LOCK)
        )

    def __call__(self, doomed):
        if staging(self.out_dir):
            return set()  # the first save of a run over an old one: all doomed are the old run's
        progress = read_progress(self.out_dir)
        done = set(progress["scored"]) | set(progress["skipped"])
        unscored = sorted((i for i in doomed if i not in done), reverse=True)
        scoring = [progress["scoring"]] if progress["scoring"] in unscored else []
        kept = set((scoring + [i for i in unscored if i not in scoring])[: self.hold])
        listed = released(self.out_dir)
        gone = [i for i in unscored if i not in kept and i not in listed]
        if gone:
            fd = os.open(os.path.join(self.out_dir, RELEASED), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, "".join(json.dumps({"iter": i}) + "\n" for i in sorted(gone)).encode())
            finally:
                os.close(fd)
        return kept


# ---------------------------------------------------------------------------- the log


class Log:
    """The watcher's records: metrics.jsonl (append), and TensorBoard and wandb when the run's
    config.json asks for them. wandb: the run's own run, resumed by the id in the checkpoint,
    its x-axis watch/iter (the training iteration)."""

    def __init__(self, out_dir):
        self.out_dir, self.cfg, self.tensorboard, self.wandb = out_dir, None, None, None

    def write(self, record, path):
        metrics.append_record(os.path.join(self.out_dir, "metrics.jsonl"), record)
        if self.cfg is None:  # read once there is a checkpoint: the run has written it by then
            try:
                with open(os.path.join(self.out_dir, "config.json")) as f:
                    self.cfg = json.load(f)
            except (OSError, ValueError):
                self.cfg = {}
        numbers = {
            k: v for k, v in record.items() if k != "iter" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self.cfg.get("tensorboard_log") and numbers:
            if self.tensorboard is None:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(os.path.join(self.out_dir, "tensorboard", "watch"))
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, record["iter"])
            self.tensorboard.flush()
        if self.cfg.get("wandb_log") and numbers:
            if self.wandb is None:
                self.wandb = self._resume_wandb(path)
            if self.wandb is not None:
                self.wandb.log({**numbers, PREFIX + "iter": record["iter"]})

    def _resume_wandb(self, path):
        """The run's wandb run, by the id in the checkpoint just scored; None (tried again at the
        next record) when training has removed it meanwhile."""
        import wandb  # optional, as in metrics.py

        try:
            if os.path.isdir(path):
                with open(os.path.join(path, checkpoint.COMMIT)) as f:
                    run_id = json.load(f).get("wandb_run_id")
            else:
                run_id = checkpoint.load(path, mmap=True).get("wandb_run_id")
        except (OSError, ValueError, UserError):
            return None
        run = wandb.init(
            project=self.cfg.get("wandb_project"),
            name=self.cfg.get("wandb_run_name"),
            id=run_id,
            resume="allow",
            dir=self.out_dir,
        )
        run.define_metric(PREFIX + "iter")
        run.define_metric(PREFIX + "*", step_metric=PREFIX + "iter")
        return run

    def close(self):
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


# ---------------------------------------------------------------------------- the watcher


class Watcher:
    """What one watcher knows: the iters done (scored or skipped), those seen on disk, and its log."""

    def __init__(self, out_dir, say):
        self.out_dir, self.say, self.log = out_dir, say, Log(out_dir)
        progress = read_progress(out_dir)
        self.done = {
            **{i: "scored" for i in progress["scored"]},
            **{i: "skipped" for i in progress["skipped"]},
            **logged(out_dir),
        }
        self.seen = set(progress["seen"]) | self.done.keys()
        self.counts = {"scored": 0, "skipped": 0}  # by this watcher
        self.save()  # from here on training keeps what it has not scored (Retention.follows)

    def save(self, scoring=None):
        done = sorted(self.done.items())
        checkpoint.write_json(
            os.path.join(self.out_dir, PROGRESS),
            {
                "scored": [i for i, s in done if s == "scored"],
                "skipped": [i for i, s in done if s == "skipped"],
                "seen": sorted(self.seen - self.done.keys()),
                "scoring": scoring,
            },
        )

    def skip(self, it, why):
        self.log.write({"iter": it, PREFIX + "skipped": why}, None)
        self.done[it] = "skipped"
        self.counts["skipped"] += 1
        self.save()

    def pending(self, live):
        """{iter: path} of the complete checkpoints not yet done. Those seen before and gone since
        are logged as skipped first: released by training (keep_unscored), or removed otherwise."""
        if live and staging(self.out_dir):
            return {}  # a new run over an old one: wait for its first checkpoint to take the directory over
        found = complete_checkpoints(self.out_dir)
        latest = os.path.join(self.out_dir, "ckpt.pt")
        if not live and os.path.isfile(latest) and not any(os.path.samefile(latest, p) for p in found.values()):
            found.setdefault(checkpoint.load(latest, mmap=True)["iter_num"], latest)  # keep_last=1: the one there is
        if found.keys() - self.seen:
            self.seen |= found.keys()
            self.save()
        let_go = released(self.out_dir)  # read after the listing: training lists a checkpoint, then removes it
        for it in sorted((let_go | self.seen) - found.keys() - self.done.keys()):
            if it in let_go:
                self.say(
                    f"note: iter {it}'s checkpoint was released by training before it was scored (keep_unscored); skipped"
                )
                self.skip(it, "released unscored (keep_unscored)")
            else:
                self.say(
                    f"note: iter {it}'s checkpoint was removed before it was scored (not by keep_unscored); skipped"
                )
                self.skip(it, "removed before it was scored")
        return {i: p for i, p in found.items() if i not in self.done}

    def score(self, it, path, score):
        self.save(scoring=it)  # Retention keeps it meanwhile
        try:
            record = score(path)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if is_complete(path) or isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self.say(f"note: {os.path.basename(path)} disappeared while it was read (training removed it); skipped")
            self.skip(it, "removed while it was read")
            return
        self.log.write({"iter": it, **{PREFIX + k: v for k, v in record.items()}}, path)
        self.done[it] = "scored"
        self.counts["scored"] += 1
        self.save()


def follow(out_dir, score, poll_s=1.0, say=print):
    """Score every complete checkpoint in out_dir once, oldest first, as training writes them,
    until the run is over and all are done. score(path) -> {name: number} (the record's names,
    without watch/). Returns {'scored': n, 'skipped': n} (by this watcher), 'run': {iter: 'scored'
    or 'skipped'} (every record of the run) and 'missing': the iters without one (should be none).
    A second watcher on out_dir is a UserError."""
    lock = ownership.lock_watcher(out_dir)
    watcher = None
    try:
        while staging(out_dir) and run_is_live(out_dir):
            time.sleep(poll_s)  # a new run over an old one: the files here are the old run's until its first checkpoint
        watcher = Watcher(out_dir, say)
        while True:
            live = run_is_live(out_dir)  # first: a checkpoint committed after this is seen below
            pending = watcher.pending(live)
            if pending:
                it = min(pending)
                watcher.score(it, pending[it], score)
            elif live:
                time.sleep(poll_s)
            else:
                return {**watcher.counts, "run": logged(out_dir), "missing": without_record(out_dir)}
    finally:
        if watcher is not None:
            watcher.log.close()
        os.ftruncate(lock, 0)  # names no holder: training sees no watcher holds it (Retention.follows)
        os.close(lock)


def summary(result):
    """follow()'s result as the watcher's last line."""
    run, missing = result["run"], result["missing"]
    scored = sum(1 for s in run.values() if s == "scored")
    return (
        f"watch: the run is over; {result['scored']} checkpoint(s) scored, {result['skipped']} skipped; "
        f"of the run's {len(run) + len(missing)}: {scored} scored, {len(run) - scored} skipped, "
        + (
            f"{len(missing)} without a record (iters {', '.join(map(str, missing))})"
            if missing
            else "none without a record"
        )
    )


def command(cfg):
    """The command of train.py's eval_async watcher (Child): eval.py --watch=True on
    eval_async_device, scoring each checkpoint's val (and test) loss on the first eval_iters x
    batch_size x block_size tokens, and HellaSwag and CORE as the loop would (when their interval
    is set)."""
    data_dir = os.path.join("data", cfg.dataset)
    tasks = (
        ["val"]
        + ["test"] * bool(glob.glob(os.path.join(glob.escape(data_dir), "test*.bin")))
        + ["hellaswag"] * bool(cfg.hellaswag_interval)
        + ["core"] * bool(cfg.core_interval)
    )
    rows = cfg.batch_size if cfg.batch_size != "auto" else cfg.total_batch_size // cfg.block_size
    keys = {
        "watch": True,
        "out_dir": cfg.out_dir,
        "dataset": cfg.dataset,
        "tasks": ",".join(tasks),
        "device": cfg.eval_async_device,
        "split_tokens": cfg.eval_iters * rows * cfg.block_size,
        "hellaswag_path": cfg.hellaswag_path,
        "hellaswag_examples": cfg.hellaswag_examples,
        "core_bundle": cfg.core_bundle,
        "core_max_per_task": cfg.core_max_per_task,
    }
    return [sys.executable, EVAL_PY, *(f"--{k}={v}" for k, v in keys.items())]


class Child:
    """The watcher as a child process of a training run (train.py's eval_async=True): started with
    the run; checked between steps (check(): a dead one is started again, each time after a longer
    wait, len(RESTART_DELAYS_S) times at most); waited for at the run's end (finish()), when it
    scores what is left and exits."""

    def __init__(self, command, out_dir, say=print):
        self.command, self.out_dir, self.say = command, out_dir, say
        self.restarts, self.restart_at = 0, None  # restart_at: time.monotonic() when a dead one starts again
        self.process = self._start()
        say(f"eval_async: the watcher (pid {self.process.pid}) scores each checkpoint: {shlex.join(command)}")

    def _start(self):
        # one process of its own, not a rank: without the variables torchrun gave the run
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
        return subprocess.Popen(self.command, env=env)

    def check(self):
        """Between steps, never waiting: a poll() of the child (no device sync); when it has died,
        one line, and it starts again once its delay has passed (checked here, at a later step)."""
        if self.restart_at is not None:
            if time.monotonic() >= self.restart_at:
                self.restart_at, self.process = None, self._start()
                self.say(
                    f"eval_async: the watcher started again (pid {self.process.pid}, restart {self.restarts} of "
                    f"{len(RESTART_DELAYS_S)}); it goes on from its progress"
                )
            return
        if self.process is None or self.process.poll() is None:
            return
        ended = f"warning: eval_async: the watcher (pid {self.process.pid}) {exit_text(self.process.returncode)}"
        if self.restarts == len(RESTART_DELAYS_S):
            self.process = None
            self.say(
                f"{ended}; no restart left ({self.restarts} used): training goes on, and its end names the "
                f"checkpoints left without a record"
            )
            return
        delay = RESTART_DELAYS_S[self.restarts]
        self.restarts += 1
        self.say(f"{ended}; it starts again in {delay:g} s (restart {self.restarts} of {len(RESTART_DELAYS_S)})")
        self.restart_at = time.monotonic() + delay

    def finish(self):
        """The run is over (train.lock released): wait for the watcher to score what is left; when
        it is not there to, or fails, name the checkpoints left without a record."""
        if self.process is not None and self.restart_at is None:
            if self.process.poll() is None:
                self.say(f"waiting for the watcher (pid {self.process.pid}) to score the last checkpoints")
            code = self.process.wait()
            if code == 0:
                return
            self.say(f"warning: eval_async: the watcher (pid {self.process.pid}) {exit_text(code)}")
        missing = without_record(self.out_dir)
        if missing:
            self.say(
                f"warning: eval_async: {len(missing)} checkpoint(s) without a watcher record (iters "
                f"{', '.join(map(str, missing))}): {shlex.join(['python', *self.command[1:]])} scores those still "
                f"on disk and logs the others as skipped"
            )


def exit_text(code):
    """'exited with code 3', or 'was killed by SIGKILL (exit code -9)'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"
