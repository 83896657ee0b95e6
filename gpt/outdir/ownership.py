"""Who may write an out_dir: one live training run at a time, and never over an earlier run
unless asked.

  the lock    the writing process (rank 0) holds an OS lock (flock) on out_dir/train.lock for the
              whole run; the file says who holds it (pid, host, start time), and is emptied when
              the run ends (a watcher, gpt/evaluation/watch.py, reads it). The OS drops the lock when the
              process dies, kill -9 included, so it never goes stale. sample.py, eval.py
              and hf.py only read and take no lock; a watcher (eval.py --watch) takes its own,
              out_dir/watch.lock: one watcher per out_dir.
  a used dir  out_dir holding a checkpoint refuses init_from='scratch' and pretrained starts; the
              user chooses --init_from=resume, --overwrite=True or another --out_dir.
              init_from='auto' resumes when there is a checkpoint and starts from scratch when not.
  takeover    a new run in a directory with an earlier run's files (--overwrite=True, or the logs
              of a run that never checkpointed) writes its config.json and metrics.jsonl into
              out_dir/staged/ and leaves the old files where they are until its first checkpoint
              is complete. Then it takes the directory over: the staged files replace the old
              ones and the old run's checkpoints and TensorBoard events are removed.

Crash points of a takeover (staged/takeover.json, written first, lists the old run's files with
their inode and mtime, which tell them from files the new run wrote under the same names):
  - before the new run's first checkpoint is complete: the old run is as it was. The next run
    into out_dir removes staged/ and says so; --init_from=resume continues the old run. One
    exception: a sharded checkpoint directory is rewritten in place, so when the new run's first
    checkpoint has the iteration of one of the old run's directories, that one is lost.
  - after it, before the takeover is done: the next run into out_dir, whatever its init_from,
    first finishes the takeover (the newest checkpoint is the new run's), then goes on.
"""

import datetime
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass, replace
from typing import Optional

import torch.distributed as dist

from configurator import UserError, as_dict
from gpt.outdir import checkpoint

try:
    import fcntl
except ImportError:  # not a POSIX system: no flock, said at start
    fcntl = None

LOCK = "train.lock"
WATCH_LOCK = "watch.lock"  # the watcher's (gpt/evaluation/watch.py)
STAGED = "staged"  # the new run's files until it takes the directory over
JOURNAL = "takeover.json"
RUN_FILES = ("config.json", "metrics.jsonl")  # what a run writes besides checkpoints; staged until the takeover
# a watcher's progress on the old run's checkpoints: removed with them
WATCH_FILES = ("watch.json", "watch_released.jsonl")
# ckpt.pt, ckpt_<iter>.pt, ckpt_best.pt, ckpt_<iter>/, ckpt_best
CHECKPOINT_NAME = re.compile(r"ckpt\.pt|ckpt_(\d+|best)(\.pt)?")
# filesystems where a lock taken on one machine may not be seen on another (it depends on the mount)
NETWORK_FILESYSTEMS = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "lustre",
    "gpfs",
    "beegfs",
    "glusterfs",
    "fuse.glusterfs",
    "ceph",
    "fuse.ceph",
    "9p",
    "afs",
    "fuse.sshfs",
    "panfs",
    "wekafs",
    "fuse.gcsfuse",
    "fuse.s3fs",
)


@dataclass
class OutDir:
    """This process's hold on out_dir: cfg with init_from='auto' resolved, the lock's file
    descriptor (rank 0; None elsewhere or where the filesystem cannot lock), and whether the run's
    files go to staged/ until its first checkpoint."""

    cfg: object
    fd: Optional[int] = None
    staging: bool = False
    created: bool = False  # out_dir did not exist before this run

    def path(self, name):
        """Where this run writes `name` (config.json, metrics.jsonl) now."""
        return os.path.join(self.cfg.out_dir, STAGED if self.staging else "", name)

    def write_config(self, cfg):
        try:
            with open(self.path("config.json"), "w") as f:
                json.dump(as_dict(cfg), f, indent=2)
        except OSError as e:
            raise UserError(_cannot_write(cfg.out_dir, e))

    def committed(self, path):
        """Checkpointer's hook: `path` is complete. The first one of a staging run takes the directory over."""
        if self.staging:
            try:
                take_over(self.cfg.out_dir)
            except OSError as e:  # the journal stays: the next run into out_dir finishes it
                print(
                    f"warning: could not finish taking over out_dir={self.cfg.out_dir} ({e}); the next run there will"
                )
            self.staging = False

    def release(self):
        if self.fd is None:
            return
        lock = os.path.join(self.cfg.out_dir, LOCK)
        if self.created and os.listdir(self.cfg.out_dir) == [LOCK]:  # a run that stopped before writing anything
            os.remove(lock)
            os.rmdir(self.cfg.out_dir)
        else:
            os.ftruncate(self.fd, 0)  # names no holder: a watcher (gpt/evaluation/watch.py) sees the run has ended
        os.close(self.fd)  # drops the lock
        self.fd = None


def claim(cfg, rt, say=print):
    """Take out_dir for this run: rank 0 locks it, finishes or undoes a takeover a dead run left,
    resolves init_from='auto', refuses a fresh start over a run, and decides on staging. The
    other ranks learn the outcome from rank 0, so a refusal ends every rank, none hangs."""
    out, error = None, None
    if rt.master:
        try:
            out = _claim(cfg, say)
        except UserError as e:
            error = str(e)
    if rt.ddp:
        outcome = [error, out.cfg.init_from if out is not None else None]
        dist.broadcast_object_list(outcome, src=0)
        error, init_from = outcome
        if not rt.master and error is None:
            out = OutDir(replace(cfg, init_from=init_from))
    if error is not None:
        raise UserError(error)
    return out


def _claim(cfg, say):
    created = not os.path.isdir(cfg.out_dir)
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        fd = os.open(os.path.join(cfg.out_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(_cannot_write(cfg.out_dir, e))
    try:
        locked = _lock(fd, cfg.out_dir, say)
    except BaseException:
        os.close(fd)
        raise
    if not locked:
        os.close(fd)
    out = OutDir(cfg, fd if locked else None, created=created)
    try:
        _recover(cfg.out_dir, say)
        found = find_run(cfg.out_dir)
        if cfg.init_from == "auto":
            out.cfg = cfg = replace(cfg, init_from="resume" if found else "scratch")
            say(
                f"init_from='auto': resuming the run in out_dir={cfg.out_dir} ({found})"
                if found
                else f"init_from='auto': no checkpoint in out_dir={cfg.out_dir}, starting from scratch"
            )
        if cfg.init_from != "resume":
            if found and not cfg.overwrite:
                raise UserError(
                    f"out_dir={cfg.out_dir} already holds a run ({found}); continue it with --init_from=resume, "
                    f"replace it with --overwrite=True, or choose another --out_dir"
                )
            out.staging = _stage(cfg.out_dir)
            if found:
                say(
                    f"note: --overwrite=True: the run in out_dir={cfg.out_dir} ({found}) stays as it is until this run's "
                    f"first checkpoint, then this run replaces it"
                )
    except BaseException as e:
        out.release()
        if isinstance(e, OSError):  # staged/, or a dead run's leftovers, could not be written or removed
            raise UserError(_cannot_write(cfg.out_dir, e))
        raise
    return out


def _cannot_write(out_dir, e):
    return f"cannot write to out_dir={out_dir} ({e.strerror or e}); choose a writable --out_dir"


def _lock(fd, out_dir, say):
    """Lock out_dir for this process and write who holds it; False (with a warning) where the
    filesystem cannot lock. A lock held by another run is a UserError naming it."""
    if fcntl is None:
        say(f"warning: no file locks on this system: nothing keeps a second run from writing to out_dir={out_dir}")
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(
            f"out_dir={out_dir} is in use by {_holder(os.path.join(out_dir, LOCK))}; wait for that run to end "
            f"(or stop it), or choose another --out_dir"
        )
    except OSError as e:  # ENOLCK, EOPNOTSUPP, ENOSYS: this filesystem does not lock
        say(
            f"warning: cannot lock out_dir={out_dir} ({e.strerror or e}): nothing keeps a second run from writing there; "
            f"start one run per out_dir"
        )
        return False
    fstype = network_filesystem(out_dir)
    if fstype:
        say(
            f"warning: out_dir={out_dir} is on {fstype}, where the lock may not be seen by runs on other machines; "
            f"start one run per out_dir"
        )
    _write_holder(fd)
    return True


def _write_holder(fd):
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)


def _holder(path, what="another run"):
    """'another run (pid 123 on h, started 2025-01-01T12:00:00+00:00)', from the lock file the holder wrote."""
    try:
        with open(path) as f:
            h = json.load(f)
        return f"{what} (pid {h['pid']} on {h['host']}, started {h['started']})"
    except (OSError, ValueError, KeyError, TypeError):  # it holds the lock but has not written its name yet
        return what


def lock_watcher(out_dir):
    """One watcher (eval.py --watch, gpt/evaluation/watch.py) per out_dir: an OS lock on out_dir/watch.lock,
    held for the watcher's life and naming it, as train.lock names the run. The file descriptor, to
    close at the end; a second watcher is a UserError naming the first."""
    path = os.path.join(out_dir, WATCH_LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(_cannot_write(out_dir, e))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(
            f"out_dir={out_dir} is already watched by {_holder(path, 'another watcher')}; let it finish "
            f"(or stop it) first"
        )
    except (OSError, AttributeError):  # no flock here: nothing keeps a second watcher out
        return fd
    _write_holder(fd)
    return fd


def network_filesystem(path, mounts="/proc/mounts"):
    """The type of the network filesystem `path` is on, or None (a local one, or no /proc/mounts)."""
    try:
        with open(mounts) as f:
            table = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    path = os.path.realpath(path)
    best, fstype = "", None
    for point, kind in table:
        point = point.replace("\\040", " ")  # /proc/mounts escapes spaces
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, kind
    return fstype if fstype in NETWORK_FILESYSTEMS else None


# ---------------------------------------------------------------------------- what an out_dir holds


def find_run(out_dir):
    """The newest checkpoint in out_dir (the one resume takes) described for a message, e.g. 'iter
    100, best val loss 1.2345, ckpt.pt'; None when there is none. Full files are memory-mapped, so
    only the few numbers read come from disk."""
    names = [n for n in _entries(out_dir) if _is_checkpoint(os.path.join(out_dir, n))]
    if not names:
        return None
    try:
        state = checkpoint.load_newest(out_dir, report=lambda message: None)
    except UserError:
        return f"checkpoint(s) that do not load: {', '.join(sorted(names))}"
    return f"{checkpoint.describe_val(state)}, {os.path.basename(state['path'])}"


def _entries(out_dir):
    return [n for n in os.listdir(out_dir) if CHECKPOINT_NAME.fullmatch(n)] if os.path.isdir(out_dir) else []


def _is_checkpoint(path):
    """A whole-looking checkpoint: a file, or a sharded directory with its commit marker."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, checkpoint.COMMIT))
    return os.path.isfile(path)


def _identity(path):
    """What tells the old run's entry from one the new run wrote under the same name: the inode and
    mtime of a file or link, and of a sharded directory's commit marker (rewritten by every save)."""
    if os.path.isdir(path) and not os.path.islink(path):
        path = os.path.join(path, checkpoint.COMMIT)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return [st.st_ino, st.st_mtime_ns]


def _old_run(out_dir):
    """{relative path: identity} of the earlier run's checkpoints and TensorBoard event files."""
    old = {name: _identity(os.path.join(out_dir, name)) for name in _entries(out_dir)}
    old.update(
        {
            name: _identity(os.path.join(out_dir, name))
            for name in WATCH_FILES
            if os.path.exists(os.path.join(out_dir, name))
        }
    )
    events = os.path.join(out_dir, "tensorboard")
    for root, _, files in os.walk(events):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), out_dir)
            old[rel] = _identity(os.path.join(out_dir, rel))
    return old


# ---------------------------------------------------------------------------- staging and takeover


def _stage(out_dir):
    """Start staging when out_dir holds an earlier run's files; True when it does. The journal
    is on disk before this run writes anything."""
    old = _old_run(out_dir)
    if not old and not any(os.path.exists(os.path.join(out_dir, name)) for name in RUN_FILES):
        return False
    staged = os.path.join(out_dir, STAGED)
    os.makedirs(staged, exist_ok=True)
    checkpoint.write_json(os.path.join(staged, JOURNAL), {"old": old})
    return True


def take_over(out_dir):
    """The new run's first checkpoint is complete: its staged files replace the old run's, then
    the old run's files are removed. Each step can be repeated, so a crash midway is finished later."""
    staged = os.path.join(out_dir, STAGED)
    with open(os.path.join(staged, JOURNAL)) as f:
        old = json.load(f)["old"]
    for name in RUN_FILES:
        if os.path.exists(os.path.join(staged, name)):
            os.replace(os.path.join(staged, name), os.path.join(out_dir, name))
    for rel, identity in old.items():
        path = os.path.join(out_dir, rel)
        if os.path.lexists(path) and _identity(path) == identity:  # not rewritten by the new run
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    shutil.rmtree(staged)


def _recover(out_dir, say):
    """A takeover a dead run left (we hold the lock, so its writer is gone): finish it when that
    run completed a checkpoint, else drop what it staged."""
    staged = os.path.join(out_dir, STAGED)
    if not os.path.isdir(staged):
        return
    try:
        with open(os.path.join(staged, JOURNAL)) as f:
            old = json.load(f)["old"]
    except (OSError, ValueError, KeyError):
        old = None  # it died before its journal was written: nothing of it is anywhere else
    if old is not None and any(
        _is_checkpoint(os.path.join(out_dir, n)) and _identity(os.path.join(out_dir, n)) != old.get(n)
        for n in _entries(out_dir)
    ):
        take_over(out_dir)
        say(
            f"note: finished the takeover of out_dir={out_dir} by the run that overwrote it (it stopped right after "
            f"its first checkpoint)"
        )
    else:
        shutil.rmtree(staged)
        say(
            f"note: removed {staged}, left by a run that stopped before its first checkpoint; the run before it is "
            f"untouched"
        )
