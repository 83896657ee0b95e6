"""One rank of a torchrun test: train.py's main(argv) after what the test injects, with what the rank
alone knows written down for the test. Also the NaN losses that in-process tests inject.

    torchrun --standalone --nproc_per_node=2 tests/train_rank.py REPORT OPTIONS TRAIN_ARGS...

OPTIONS, JSON: nan_at (with nan_ranks, null: every rank), backend (torch.compile's), record (see
`record`), local_world_size. The rank writes REPORT<rank>.out, .err and .json (its exit code and
torch.compile's counters)."""

import functools
import json
import os
import sys
from contextlib import contextmanager, nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextmanager
def nan_loss(model):
    """Every forward of `model` returns a NaN loss while inside: a diverged step (NaN gradients too)."""
    handle = model.register_forward_hook(lambda module, args, out: (out[0], out[1] * float("nan")))
    try:
        yield
    finally:
        handle.remove()


def nan_steps(setattr, iters, ranks=None):
    """train.py's steps at `iters` (on `ranks`; None: every rank) get a NaN loss, the iteration learned
    from get_lr, which train.py calls just before each step. `setattr`: monkeypatch's, or the builtin."""
    from gpt.train import optim, step

    get_lr, train_step, now = optim.get_lr, step.train_step, {}

    def recording_get_lr(it, cfg):
        now["iter"] = it
        return get_lr(it, cfg)

    def nan_train_step(model, optimizer, scaler, next_batch, lr, accum_steps, grad_clip, rt):
        bad = now.get("iter") in iters and (ranks is None or rt.rank in ranks)
        with nan_loss(model) if bad else nullcontext():
            return train_step(model, optimizer, scaler, next_batch, lr, accum_steps, grad_clip, rt)

    setattr(optim, "get_lr", recording_get_lr)
    setattr(step, "train_step", nan_train_step)


def record(report):
    """Checkpoint writes to report.writes, the last checkpoint's weights to report.weights.pt; returns
    torch.compile's counters."""
    import torch
    from torch._dynamo.utils import counters

    from gpt.outdir import checkpoint

    save, make = checkpoint.save, checkpoint.make_checkpoint

    def recording_save(state, path):
        with open(report + ".writes", "a") as f:
            f.write(path + "\n")
        save(state, path)

    def make_and_keep(*args):
        state = make(*args)
        torch.save(state["model"], report + ".weights.pt")
        return state

    checkpoint.save, checkpoint.make_checkpoint = recording_save, make_and_keep
    return counters


def main(report, options, argv):
    import torch

    from configurator import run_main

    report += os.environ["RANK"]
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(report + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    if options.get("local_world_size"):
        os.environ["LOCAL_WORLD_SIZE"] = str(options["local_world_size"])
    if options.get("backend"):
        torch.compile = functools.partial(torch.compile, backend=options["backend"])
    if options.get("nan_at"):
        nan_steps(setattr, set(options["nan_at"]), options.get("nan_ranks") and set(options["nan_ranks"]))
    counters = record(report) if options.get("record") else {}
    import train  # after the patches: it takes train_step by name as it is imported

    code = 1  # an uncaught exception: its traceback is on stderr
    try:
        run_main(lambda: train.main(argv))
    except SystemExit as e:
        code = e.code
        raise
    finally:
        counted = {k: {str(a): b for a, b in v.items()} for k, v in counters.items()}
        with open(report + ".json", "w") as f:
            json.dump({"exit": code, "counters": counted}, f)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:])
