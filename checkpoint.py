"""Checkpoints that never corrupt: written atomically, loaded without unpickling code.

A checkpoint is a dict of tensors and plain values (see train.py's make_checkpoint):
model, optimizer, scaler, iter_num, best_val_loss, config, model_args, tokenizer, rng.
The key names match nanoGPT's, so its notebooks and scripts can read ours.
"""

import os
import re

import torch

import tokenizer
from configurator import UserError
from model import GPT, GPTConfig


def save(state, path):
    """Write to a temporary file beside `path`, flush it to disk, then rename over `path`.
    A crash at any point leaves either the old file or the new one, never half of one."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # disk full, permission, quota: the old checkpoint is still whole
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise UserError(f"could not write checkpoint {path} ({e.strerror or e}); the previous checkpoint is untouched: "
                        f"free space or fix the permissions, then --init_from=resume")
    # make the rename itself durable
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def link_or_copy(src, dst):
    """Make dst the same checkpoint as src without writing it twice (atomically)."""
    tmp = dst + ".tmp"
    if os.path.exists(tmp):
        os.remove(tmp)
    try:
        os.link(src, tmp)
    except OSError:  # filesystems without hard links
        save(load(src), dst)
        return
    os.replace(tmp, dst)


def save_rotating(state, out_dir, keep_last=1):
    """Write `state` as out_dir/ckpt.pt, always the newest checkpoint. With keep_last > 1 it is
    first written as ckpt_<iter>.pt, ckpt.pt becomes a hard link to it, and only then are the
    numbered files beyond the keep_last newest removed. Returns the path of ckpt.pt."""
    latest = os.path.join(out_dir, "ckpt.pt")
    if keep_last <= 1:
        save(state, latest)
        return latest
    numbered = os.path.join(out_dir, f"ckpt_{state['iter_num']:07d}.pt")
    save(state, numbered)
    link_or_copy(numbered, latest)
    history = _numbered(out_dir)
    for iter_num in sorted(history, reverse=True)[keep_last:]:
        os.remove(history[iter_num])
    return latest


def _numbered(out_dir):
    """{iter: path} of the ckpt_<iter>.pt files in out_dir."""
    found = {}
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        m = re.fullmatch(r"ckpt_(\d+)\.pt", name)
        if m:
            found[int(m.group(1))] = os.path.join(out_dir, name)
    return found


def load_newest(out_dir, map_location="cpu", report=print):
    """The checkpoint in out_dir with the highest iter_num among those that load whole:
    ckpt.pt, or a ckpt_<iter>.pt when ckpt.pt is missing, damaged or older. Files are
    memory-mapped, so looking at several costs no more memory than loading one."""
    latest = os.path.join(out_dir, "ckpt.pt")
    candidates = [latest] + [p for _, p in sorted(_numbered(out_dir).items(), reverse=True)]
    candidates = [p for p in candidates if os.path.isfile(p)]
    if not candidates:
        return load(latest, map_location)  # its one-line "no checkpoint" error
    best, problems = None, []
    for path in candidates:
        try:
            state = load(path, map_location, mmap=True)
        except UserError as e:
            problems.append(str(e))
            continue
        if best is None or state["iter_num"] > best[1]["iter_num"]:
            best = (path, state)
    if best is None:
        raise UserError(problems[0] if len(problems) == 1 else f"no readable checkpoint in {out_dir}: {'; '.join(problems)}")
    for problem in problems:
        report(f"note: skipped {problem}")
    if best[0] != latest:
        report(f"note: resuming from {best[0]} (iter {best[1]['iter_num']}), the newest complete checkpoint")
    return best[1]


def load(path, map_location="cpu", mmap=False):
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}; train one first (python train.py ...) or check --out_dir")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path} is not a readable checkpoint ({reason[:200]})")
    if not isinstance(state, dict) or "model" not in state or "model_args" not in state:
        raise UserError(f"{path} is not a checkpoint of this trainer (no model/model_args inside)")
    return state


def load_model(out_dir, which="best", map_location="cpu", report=print):
    """(model, tokenizer description) from a training run's checkpoint: ckpt_best.pt when
    which='best' and it exists, else ckpt.pt. The model is in float32 on map_location."""
    if not os.path.isdir(out_dir):
        raise UserError(f"out_dir={out_dir} does not exist; point --out_dir at a training run's directory")
    path = os.path.join(out_dir, "ckpt.pt")
    best = os.path.join(out_dir, "ckpt_best.pt")
    if which == "best" and os.path.exists(best):
        path = best
    state = load(path, map_location=map_location)
    model = GPT(GPTConfig(**state["model_args"]))
    model.load_state_dict(model_state(state))
    # checkpoints from nanoGPT carry no tokenizer: look in their data directory, as it did
    tok_spec = state.get("tokenizer") or tokenizer.describe(os.path.join("data", state["config"].get("dataset", "")))
    report(f"loaded {path} (iter {state.get('iter_num', '?')}, best val loss {state.get('best_val_loss', float('nan')):.4f})")
    return model, tok_spec


def model_state(state):
    """The model's state_dict from a checkpoint of ours or of nanoGPT: without the
    '_orig_mod.' prefix of a torch.compile'd model, and with the token embedding padded to
    the multiple of 64 rows our GPT allocates (nanoGPT's char models have exactly 65)."""
    weights = {k.removeprefix("_orig_mod."): v for k, v in state["model"].items()}
    rows = GPTConfig(vocab_size=state["model_args"]["vocab_size"]).padded_vocab_size
    for key in ("transformer.wte.weight", "lm_head.weight"):
        w = weights.get(key)
        if w is not None and w.size(0) < rows:
            weights[key] = torch.cat([w, w.new_zeros(rows - w.size(0), w.size(1))])
    return weights
