"""train.py's saves (Checkpointer): a checkpoint of either format (gpt/outdir/checkpoint.py) written
now or in the background, committed at a step boundary once every rank's part is written, the
keep_last history rotated and ckpt_best linked."""

import concurrent.futures
import os
import shutil

import torch
import torch.distributed as dist

from configurator import UserError
from gpt.outdir.checkpoint import (
    COMMIT,
    link_or_copy,
    make_checkpoint,
    save_rotating,
    sharded_dirs,
    sharded_meta,
    sharded_state,
    single_process_is_meant,
    write_failed,
    write_json,
)


class Checkpointer:
    """train.py's saves, in either format, synchronously or in the background. At most one save
    is in flight: poll() at every step boundary commits it once every rank's part is written
    (it never waits, and touches only host memory), and wait() blocks for it (before the next
    save, at the end, on a stop). A failed write is one UserError on every rank, and the previous
    complete checkpoint stays. `latest` is the newest committed checkpoint's path. on_commit(path)
    is called on rank 0 as each checkpoint becomes complete, before ckpt_best and the rotation."""

    def __init__(self, out_dir, fmt, keep_last, asynchronous, rt, on_commit=None, spare=None):
        self.out_dir, self.fmt, self.keep_last, self.asynchronous, self.rt = out_dir, fmt, keep_last, asynchronous, rt
        self.on_commit, self.spare = on_commit, spare  # spare: gpt/evaluation/watch.py's Retention, or None
        self.latest = os.path.join(out_dir, "ckpt.pt")
        self.pending = None  # (future, path, best, checkpoint.json's content or None)
        # gloo groups of their own, so host-side checks and DCP's background thread never
        # interleave with the training's collectives, or with each other's
        self.status = dist.new_group(backend="gloo", timeout=rt.timeout) if rt.ddp else None
        self.dcp_group = dist.new_group(backend="gloo", timeout=rt.timeout) if rt.ddp and fmt == "sharded" else None
        self.writer = concurrent.futures.ThreadPoolExecutor(1) if asynchronous and fmt == "full" else None
        single_process_is_meant()

    def save(self, raw_model, optimizer, scaler, fsdp, info, batches, best=False):
        """Stage the state (a collective call under DDP/FSDP) and write it; `best` links
        ckpt_best to it once it is complete. info: model_args, config, tokenizer, iter_num,
        best_val_loss, wandb_run_id."""
        self.wait()
        meta, future = None, None
        if self.fmt == "full":
            path = os.path.join(self.out_dir, "ckpt.pt")
            state = make_checkpoint(raw_model, optimizer, scaler, fsdp, info, batches, self.rt)
            if self.rt.master and self.asynchronous:
                future = self.writer.submit(save_rotating, _to_host(state), self.out_dir, self.keep_last, self._spare())
            elif self.rt.master:
                future = _done(save_rotating, state, self.out_dir, self.keep_last, self._spare())
        else:
            import torch.distributed.checkpoint as dcp

            path = os.path.join(self.out_dir, f"ckpt_{info['iter_num']:07d}")
            if self.rt.master and os.path.exists(os.path.join(path, COMMIT)):
                os.remove(os.path.join(path, COMMIT))  # a directory being rewritten is not complete
            tensors, param_groups = sharded_state(raw_model, optimizer, self.rt)
            meta = sharded_meta(scaler, info, batches, param_groups, self.rt)
            if self.asynchronous:  # copies the tensors to host memory now, writes them in a thread
                future = dcp.async_save(
                    tensors, checkpoint_id=path, process_group=self.dcp_group, no_dist=not self.rt.ddp
                )
            else:
                future = _done(
                    dcp.save, tensors, checkpoint_id=path, process_group=self.dcp_group, no_dist=not self.rt.ddp
                )
        self.pending = (future, path, best, meta)
        if not self.asynchronous:
            self.wait()

    def poll(self):
        """Commit the save in flight if every rank's part is written; raise if it failed."""
        if self.pending is None:
            return
        future = self.pending[0]
        if self._agree(future is not None and not future.done()):  # a concurrent.futures check: no device sync
            return
        self._finish()

    def wait(self):
        if self.pending is not None:
            if self.pending[0] is not None:
                concurrent.futures.wait([self.pending[0]])
            self._finish()

    def _spare(self):
        """This save's spare: the Retention while a watcher follows the run, else None (keep_last
        alone). Asked at each save, since a watcher can be started by hand mid-run."""
        return self.spare if self.spare is not None and self.spare.follows() else None

    def _agree(self, flag):
        """True when `flag` is true on any rank (a CPU all-reduce on our own gloo group)."""
        if self.status is None:
            return flag
        t = torch.tensor([float(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.status)
        return bool(t.item())

    def _finish(self):
        future, path, best, meta = self.pending
        self.pending = None
        error = future.exception() if future is not None else None
        if self._agree(error is not None):
            if error is None:
                raise UserError(
                    f"another rank could not write checkpoint {path} (see its message); the previous "
                    f"checkpoint is untouched: free space or fix the permissions, then --init_from=resume"
                )
            raise UserError(str(error) if isinstance(error, UserError) else write_failed(path, _cause(error)))
        if self.rt.master:
            if meta is not None:
                write_json(os.path.join(path, COMMIT), meta)  # last: from here on the directory is complete
            if self.on_commit is not None:
                self.on_commit(path)
            if best:
                _link_best(path)
            if meta is not None:
                self._rotate_sharded(path)
        self.latest = path

    def _rotate_sharded(self, latest):
        """Keep the keep_last newest complete directories, ckpt_best's and `latest`, the one just
        committed, and those the spare keeps; remove the rest, incomplete ones included (what a crash left)."""
        best = os.path.realpath(os.path.join(self.out_dir, "ckpt_best"))
        dirs = sorted(sharded_dirs(self.out_dir).items(), reverse=True)
        complete = [(i, p) for i, p in dirs if os.path.isfile(os.path.join(p, COMMIT))]
        doomed = [i for i, p in complete[self.keep_last :] if os.path.realpath(p) != best and p != latest]
        spare = self._spare()
        spared = spare(doomed) if spare else set()
        kept = {p for _, p in complete[: self.keep_last]} | {p for i, p in complete if i in spared}
        for _, p in dirs:
            if p not in kept and os.path.realpath(p) != best and p != latest:
                shutil.rmtree(p, ignore_errors=True)


def _done(fn, *args, **kwargs):
    """A finished Future holding fn's result or exception: the synchronous path looks like the other."""
    from torch.distributed.checkpoint.api import CheckpointException

    future = concurrent.futures.Future()
    try:
        future.set_result(fn(*args, **kwargs))
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        future.set_exception(e)
    return future


def _cause(error):
    """The first OSError (or whatever) behind DCP's CheckpointException, which wraps every rank's."""
    for exc, _ in getattr(error, "failures", {}).values():
        return exc
    return error


def _to_host(obj):
    """A copy of a checkpoint dict with every tensor in (unshared) host memory: the background
    write must not see the weights the next steps change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def _link_best(path):
    """ckpt_best.pt, a hard link to the file, or ckpt_best, a relative symlink to the directory."""
    if os.path.isdir(path):
        link = os.path.join(os.path.dirname(path), "ckpt_best")
        if os.path.lexists(link + ".tmp"):
            os.remove(link + ".tmp")
        os.symlink(os.path.basename(path), link + ".tmp")
        os.replace(link + ".tmp", link)
    else:
        link_or_copy(path, os.path.join(os.path.dirname(path), "ckpt_best.pt"))
