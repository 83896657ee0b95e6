"""Scoring a run's checkpoints as they land, without pausing it: the watcher behind
`python eval.py --watch=True`, which train.py's eval_async=True starts beside the run. The scoring
itself is the caller's (eval.py's tasks): follow() takes it as a function of a checkpoint's path.

  what         each complete checkpoint once, oldest first: ckpt_<iter>.pt (written whole, then
               renamed into place) and ckpt_<iter>/ once its checkpoint.json is there. ckpt.pt
               alone (keep_last=1, rewritten at every save) is scored once the run has ended.
  the records  one line per checkpoint in out_dir/metrics.jsonl, {"iter": N, "watch/<name>": ...},
               each line one write() in append mode, as the trainer's: no line is torn or
               interleaved (gpt/metrics.py). Also TensorBoard (out_dir/tensorboard/watch) and the
               run's wandb run.
  progress     out_dir/watch.json, replaced atomically: the iters scored and skipped, and the one
               being scored. A restart also reads the records (a kill can fall between a record
               and the progress), so none is scored twice and none is skipped.
  one at once  out_dir/watch.lock (gpt/outdir.py): a second watcher is refused, naming the first.
  the end      once the run is over (train.lock names no live process: the run released it, or
               died) and every complete checkpoint is scored.
  retention    under eval_async, train.py's checkpoint rotation asks Retention which of the
               checkpoints past keep_last to keep: the unscored ones, keep_unscored at most (the
               newest). Older unscored ones are listed in out_dir/watch_released.jsonl, then
               removed, and the watcher logs them as skipped. Training never waits for it.
"""

import json
import os
import re
import shlex
import socket
import subprocess
import time

from configurator import UserError
from gpt import checkpoint, metrics, outdir

PREFIX = "watch/"  # the watcher's names in metrics.jsonl, TensorBoard and wandb
PROGRESS, RELEASED = outdir.WATCH_FILES  # watch.json, watch_released.jsonl
NUMBERED = re.compile(r"ckpt_(\d+)(\.pt)?")
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
    """True while a training run holds out_dir: train.lock names a process, and on this host one
    that is alive (a run that releases the lock empties the file; one killed leaves its pid)."""
    try:
        with open(os.path.join(out_dir, outdir.LOCK)) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return False
    if holder.get("host") != socket.gethostname():
        return True  # no way to ask another machine: until it releases the lock
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


# ---------------------------------------------------------------------------- progress


def read_progress(out_dir):
    """{'scored': [iter, ...], 'skipped': [...], 'scoring': iter or None} from watch.json."""
    try:
        with open(os.path.join(out_dir, PROGRESS)) as f:
            progress = json.load(f)
    except (OSError, ValueError):
        progress = {}
    return {
        "scored": progress.get("scored", []),
        "skipped": progress.get("skipped", []),
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


class Retention:
    """saver.Checkpointer's spare: of the checkpoints rotation would remove (doomed, iters),
    keep those the watcher has not scored, `hold` at most (the newest), and the one it is scoring.
    The others are listed in watch_released.jsonl before they are removed."""

    def __init__(self, out_dir, hold):
        self.out_dir, self.hold = out_dir, hold

    def __call__(self, doomed):
        progress = read_progress(self.out_dir)
        done = set(progress["scored"]) | set(progress["skipped"])
        unscored = sorted((i for i in doomed if i not in done), reverse=True)
        kept = set(unscored[: self.hold]) | ({progress["scoring"]} & set(doomed))
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
    """What one watcher knows: the iters done (scored or skipped), and its log."""

    def __init__(self, out_dir, say):
        self.out_dir, self.say, self.log = out_dir, say, Log(out_dir)
        progress = read_progress(out_dir)
        self.done = {
            **{i: "scored" for i in progress["scored"]},
            **{i: "skipped" for i in progress["skipped"]},
            **logged(out_dir),
        }

    def save(self, scoring=None):
        done = sorted(self.done.items())
        checkpoint.write_json(
            os.path.join(self.out_dir, PROGRESS),
            {
                "scored": [i for i, s in done if s == "scored"],
                "skipped": [i for i, s in done if s == "skipped"],
                "scoring": scoring,
            },
        )

    def skip(self, it, why):
        self.log.write({"iter": it, PREFIX + "skipped": why}, None)
        self.done[it] = "skipped"
        self.save()

    def pending(self, live):
        """{iter: path} of the complete checkpoints not yet done."""
        if live and os.path.isdir(os.path.join(self.out_dir, outdir.STAGED)):
            return {}  # a new run over an old one: wait for its first checkpoint to take the directory over
        found = complete_checkpoints(self.out_dir)
        latest = os.path.join(self.out_dir, "ckpt.pt")
        if not live and os.path.isfile(latest) and not any(os.path.samefile(latest, p) for p in found.values()):
            found.setdefault(checkpoint.load(latest, mmap=True)["iter_num"], latest)  # keep_last=1: the one there is
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
        self.save()


def follow(out_dir, score, poll_s=1.0, say=print):
    """Score every complete checkpoint in out_dir once, oldest first, as training writes them;
    return {'scored': n, 'skipped': n} once the run is over and all are done. score(path) -> {name:
    number} (the record's names, without watch/). A second watcher on out_dir is a UserError."""
    lock = outdir.lock_watcher(out_dir)
    watcher, counts = Watcher(out_dir, say), {"scored": 0, "skipped": 0}
    try:
        while True:
            live = run_is_live(out_dir)  # first: a checkpoint committed after this is seen below
            for it in sorted(released(out_dir) - watcher.done.keys()):
                say(
                    f"note: iter {it}'s checkpoint was released by training before it was scored (keep_unscored); skipped"
                )
                watcher.skip(it, "released unscored (keep_unscored)")
                counts["skipped"] += 1
            pending = watcher.pending(live)
            if not pending:
                if not live:
                    return counts
                time.sleep(poll_s)
                continue
            it = min(pending)
            watcher.score(it, pending[it], score)
            counts[watcher.done[it]] += 1
    finally:
        watcher.log.close()
        os.close(lock)


class Child:
    """The watcher as a child process of a training run (train.py's eval_async=True): started with
    the run, waited for at its end, when it scores what is left and exits."""

    def __init__(self, command, say=print):
        self.command, self.say = command, say
        # one process of its own, not a rank: without the variables torchrun gave the run
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
        self.process = subprocess.Popen(command, env=env)
        say(f"eval_async: the watcher (pid {self.process.pid}) scores each checkpoint: {shlex.join(command)}")

    def finish(self):
        if self.process.poll() is None:
            self.say(f"waiting for the watcher (pid {self.process.pid}) to score the last checkpoints")
        code = self.process.wait()
        if code:
            self.say(
                f"warning: the watcher exited with code {code}; score what it left with "
                f"{shlex.join(['python', *self.command[1:]])}"
            )
