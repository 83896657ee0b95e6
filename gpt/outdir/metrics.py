"""The run's log: out_dir/metrics.jsonl, one JSON object per line, with wandb and TensorBoard
fed the same records when asked for; and the lines train.py prints: the run's description, each
logged step, and the durations in them."""

import json
import os
import textwrap
import time
import weakref

from configurator import as_dict, changed
from gpt.device import runtime

try:
    import fcntl
except ImportError:  # not a POSIX system: no flock
    fcntl = None


class MetricsLog:
    """out_dir/metrics.jsonl, one JSON object per line, appended to and never truncated; wandb
    and TensorBoard, when asked for, are fed the same records. On resume, records past the
    checkpoint are dropped from all three, since the resumed run logs those steps again.
    `path`: where the file is written, when not in out_dir (a new run's staged/, ownership.py)."""

    def __init__(self, out_dir, resume_iter, cfg, wandb_run_id=None, path=None):
        self.path = path or os.path.join(out_dir, "metrics.jsonl")
        if resume_iter is not None:
            self._truncate(resume_iter)
        # one handle for the whole run: it follows the file when ownership.py moves it into place.
        # Unbuffered, in append mode: each record is one write() at the file's end, never torn or
        # interleaved with a watcher's (gpt/evaluation/watch.py appends the same way), and a killed run keeps it
        self.file = open(self.path, "ab", buffering=0)
        weakref.finalize(self, self.file.close)
        self.wandb = self.tensorboard = self.wandb_run_id = None
        if cfg.wandb_log:
            import wandb  # optional dependencies, imported only when asked for

            # the run id travels in the checkpoint, so a resumed run continues the same wandb run
            self.wandb = wandb.init(
                project=cfg.wandb_project,
                name=cfg.wandb_run_name,
                config=as_dict(cfg),
                id=wandb_run_id,
                resume="allow",
                dir=out_dir,
            )
            self.wandb_run_id = self.wandb.id
        if cfg.tensorboard_log:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a run that died after its last checkpoint wrote past it
            self.tensorboard = SummaryWriter(
                os.path.join(out_dir, "tensorboard"), purge_step=None if resume_iter is None else resume_iter + 1
            )

    def _truncate(self, resume_iter):
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_EX)  # a watcher's append (append_record) waits until the file is replaced
            records = [json.loads(line) for line in f if line.strip()]
            keep = [
                r for r in records if r["iter"] < resume_iter or ("loss" not in r and r["iter"] == resume_iter)
            ]  # evals
            with open(self.path + ".tmp", "w") as tmp:
                tmp.writelines(json.dumps(r) + "\n" for r in keep)
            os.replace(self.path + ".tmp", self.path)

    def write(self, record):
        self.file.write((json.dumps(record) + "\n").encode())  # json keeps every digit of a float
        values = {k: v for k, v in record.items() if k != "iter" and v is not None}
        if self.wandb is not None:
            self.wandb.log(values, step=record["iter"])
        if self.tensorboard is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):  # a failed eval's message is text
                    self.tensorboard.add_scalar(key, value, record["iter"])
            self.tensorboard.flush()  # a preempted run keeps what it logged


def append_record(path, record):
    """One record at the end of a run's metrics.jsonl from another process (gpt/evaluation/watch.py): one
    write() in append mode, as MetricsLog's, so lines never tear or interleave; under the lock a
    resuming run holds while it rewrites the file, and into the file that is there afterwards."""
    line = (json.dumps(record) + "\n").encode()
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # else a resuming run replaced it meanwhile: reopen
                os.write(fd, line)
                return
        finally:
            os.close(fd)


def describe(cfg, rt, n_params, tokens_per_iter, accum_steps, groups=1, resumed_at=None):
    """The lines a run starts with: the keys its config sets away from the defaults (config.json
    has them all), then its model, batch and device."""
    config = textwrap.fill(
        "config, where it differs from the defaults (python train.py --help): "
        + " ".join(f"{k}={v!r}" for k, v in changed(cfg).items()),
        120,
        subsequent_indent="  ",
    )
    shape = f"{groups} replica groups x " if groups > 1 else ""
    resuming = f" | resuming at iter {resumed_at}" if resumed_at is not None else ""
    run = (
        f"{n_params / 1e6:.2f}M parameters | {tokens_per_iter:,} tokens/iter "
        f"({shape}{rt.world_size} rank(s) x {accum_steps} micro-steps x {cfg.batch_size} x {cfg.block_size}) | "
        f"{rt.device} {str(rt.dtype).removeprefix('torch.')}{resuming}"
    )
    return f"{config}\n{run}"


def step_line(record, tflops, eta_s, groups=1):
    """The log line of a training step's record (train.py's log_step): tflops per device, eta_s
    seconds to the end; with replica groups (`groups` of them), those that took part and the
    bytes this group sent."""
    r = record
    clipped = " (clipped)" if r["clipped"] else ""
    sync = f", {r['groups']}/{groups} groups, sync {r['sync_bytes']:,} B" if "groups" in r else ""
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    return (
        f"iter {r['iter']}: loss {r['loss']:.4f}, lr {r['lr']:.2e}, grad norm {r['grad_norm']:.3g}{clipped}, "
        f"{r['dt_ms']:.1f} ms/iter, {r['tokens_per_s']:,.0f} tok/s{sync}, "
        f"{tflops:.3g} TFLOPS/device, mfu {mfu}, eta {format_duration(eta_s)}"
    )


def eval_record(results):
    """Scores, {task: results} (eval.py's, or an eval of train.py's loop), as one metrics record
    in train.py's names: val_loss, val_bpb, hellaswag_acc, hellaswag_acc_norm (per token),
    hellaswag_acc_norm_chars, mc_..., core, core/<task>."""
    out = {}
    for task, r in results.items():
        if task in ("val", "test"):
            out.update({f"{task}_loss": r["loss"], f"{task}_bpb": r["bpb"]})
        elif task == "core":
            out.update({"core": r["core"], **{f"core/{k}": v["centered"] for k, v in r["tasks"].items()}})
        else:
            out.update(
                {
                    f"{task}_acc": r["acc"],
                    f"{task}_acc_norm": r["acc_norm_tokens"],
                    f"{task}_acc_norm_chars": r["acc_norm_chars"],
                }
            )
    return out


def format_duration(seconds):
    seconds = int(seconds)
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class Throughput:
    """Wall-clock time per iteration over the window since the last log. The window restarts after
    an eval or HellaSwag (not training time), and the first window of a process holds compilation
    and allocator warm-up, so it gives no MFU."""

    def __init__(self, rt):
        self.rt, self.start, self.iters, self.warm = rt, None, 0, False

    def restart(self):
        self.start = None

    def begin_step(self):
        if self.start is None:
            runtime.synchronize(self.rt)
            self.start, self.iters = time.perf_counter(), 0

    def end_step(self):
        self.iters += 1

    def read(self):
        """(seconds per iteration over the window, whether it was warm); starts the next window.
        The caller has already waited for the device (it read the loss)."""
        runtime.synchronize(self.rt)
        now = time.perf_counter()
        dt, warm = (now - self.start) / self.iters, self.warm
        self.start, self.iters, self.warm = now, 0, True
        return dt, warm


def finished_line(out_dir, iter_num, seconds, best_val_loss, best_val_iter, latest):
    """A run's last line: how long, its best val and where, the checkpoint sample.py reads (ckpt_best
    when there is one, else `latest`), and the command that samples from it."""
    best = next((p for p in ("ckpt_best.pt", "ckpt_best") if os.path.exists(os.path.join(out_dir, p))), None)
    path = os.path.join(out_dir, best) if best else latest
    where = f" at iter {best_val_iter}" if best_val_iter is not None else ""
    return (
        f"done: iter {iter_num} in {format_duration(seconds)}, best val loss {best_val_loss:.4f}{where}, "
        f"in {path}; sample from it: python sample.py --out_dir={out_dir}"
    )
