"""One rank of a torchrun test: train.py's main(argv) after what the test injects, with what the rank
alone knows written down for the test; then each run of OPTIONS' `then`, in the same processes (a
launch's ~11 CPU-s of imports paid once). Also the NaN losses that in-process tests inject.

    torchrun --standalone --nproc_per_node=2 tests/train_rank.py REPORT OPTIONS TRAIN_ARGS...

OPTIONS, JSON: nan_at (with nan_ranks, null: every rank), backend (torch.compile's), record (see
`record`), local_world_size, then ([[REPORT, OPTIONS, TRAIN_ARGS], ...]: the runs after this one, while
each exits 0). A run's rank writes REPORT<rank>.out, .err and .json (its exit code and torch.compile's
counters)."""

import functools
import importlib.util
import json
import os
import sys
from contextlib import contextmanager, nullcontext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


@contextmanager
def nan_loss(model):
    """Every forward of `model` returns a NaN loss while inside: a diverged step (NaN gradients too)."""
    with model.register_forward_hook(lambda module, args, out: (out[0], out[1] * float("nan"))):
        yield


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


def record(report, setattr):
    """Checkpoint writes to report.writes, the last checkpoint's weights to report.weights.pt."""
    import torch

    from gpt.outdir import checkpoint, saver

    save, make = checkpoint.save, checkpoint.make_checkpoint

    def recording_save(state, path):
        with open(report + ".writes", "a") as f:
            f.write(path + "\n")
        save(state, path)

    def make_and_keep(*args):
        state = make(*args)
        torch.save(state["model"], report + ".weights.pt")
        return state

    setattr(checkpoint, "save", recording_save)
    setattr(checkpoint, "make_checkpoint", make_and_keep)
    setattr(saver, "make_checkpoint", make_and_keep)  # which imports it by name, once for every run


def run(report, options, argv, namespace):
    """One run: its patches made, train.py loaded afresh after them (it takes train_step by name),
    dynamo's caches and counters emptied (it compiles from nothing, as a new process would); its report
    written and its patches undone. Its exit code."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from configurator import run_main

    os.makedirs(os.path.dirname(report), exist_ok=True)  # a later run's
    report += os.environ["RANK"]
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(report + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    if options.get("local_world_size"):
        os.environ["LOCAL_WORLD_SIZE"] = str(options["local_world_size"])
    patched = []

    def patch(obj, name, value):  # setattr, undone when the run ends
        patched.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    if namespace:  # a run after the first: its group under keys of its own in torchrun's store (env://); made
        # again under the same keys, it would read the last one's addresses there (pytorch/pytorch#135712)
        store, rank, world_size = next(dist.rendezvous("env://"))
        group = dict(store=dist.PrefixStore(namespace, store), rank=rank, world_size=world_size)
        patch(dist, "init_process_group", functools.partial(dist.init_process_group, **group))
    if options.get("backend"):
        patch(torch, "compile", functools.partial(torch.compile, backend=options["backend"]))
    if options.get("nan_at"):
        nan_steps(patch, set(options["nan_at"]), options.get("nan_ranks") and set(options["nan_ranks"]))
    if options.get("record"):
        record(report, patch)
    torch._dynamo.reset()
    counters.clear()
    spec = importlib.util.spec_from_file_location("train", os.path.join(REPO, "train.py"))
    spec.loader.exec_module(train := importlib.util.module_from_spec(spec))
    code = 1  # an uncaught exception: its traceback is on stderr
    try:
        run_main(lambda: train.main(argv))
    except SystemExit as e:
        return (code := e.code)
    finally:
        counted = {k: {str(a): b for a, b in v.items()} for k, v in counters.items()}
        with open(report + ".json", "w") as f:
            json.dump({"exit": code, "counters": counted}, f)
        sys.stdout.flush()
        for obj, name, value in reversed(patched):
            setattr(obj, name, value)


def main(report, options, argv):
    for i, (report, options, argv) in enumerate([(report, options, argv), *options.get("then", [])]):
        if code := run(report, options, argv, i and f"run{i}/"):
            break
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:])
