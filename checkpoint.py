"""Checkpoints that never corrupt: written atomically, loaded without unpickling code.

A checkpoint is a dict of tensors and plain values (see train.py's make_checkpoint):
model, optimizer, scaler, iter_num, best_val_loss, config, model_args, tokenizer, rng.
The key names match nanoGPT's, so its notebooks and scripts can read ours.
"""

import os

import torch

from configurator import UserError
from model import GPTConfig


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
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f"could not write checkpoint {path} ({e.strerror}); the previous one is untouched")
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


def load(path, map_location="cpu"):
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}; train one first (python train.py ...) or check --out_dir")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path} is not a readable checkpoint ({reason[:200]})")
    if not isinstance(state, dict) or "model" not in state or "model_args" not in state:
        raise UserError(f"{path} is not a checkpoint of this trainer (no model/model_args inside)")
    return state


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
