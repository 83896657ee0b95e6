"""The training data as the loop sees it: a split's token ids (memory-mapped or in RAM), random
training windows from a reproducible generator, and the fixed windows every eval scores.

    data = load_split("data/shakespeare_char", "train")
    batches = TrainBatches(data, batch_size=12, block_size=256, seed=1337, rt=rt)
    x, y = batches()                                   # (B, T) each, on rt.device; y is x shifted by one
"""

import numpy as np
import torch

import runtime
from data import tokens


def load_split(data_dir, split, mode="auto", share=1):
    """A split's token ids (data/tokens.py: one file or many shards, read as one sequence):
    memory-mapped, or read into RAM when mode='ram' or ('auto' and the files are small against
    free memory, split `share` ways between the ranks on this machine)."""
    data = tokens.Tokens.open(data_dir, split)
    if mode == "ram" or (mode == "auto" and data.nbytes * share < runtime.free_memory() / 4):
        data = data.in_ram()  # random windows from RAM avoid page faults on every batch
    return data


def get_batch(data, offsets, block_size, rt):
    """Windows starting at `offsets` (B,) -> x, y (B, T) on the device, y = x shifted by one.
    One vectorized gather of (B, T+1) ids and one host-to-device copy."""
    rows = data[offsets[:, None] + np.arange(block_size + 1)]
    t = torch.from_numpy(rows.astype(np.int64))
    if rt.device_type == "cuda":
        t = t.pin_memory().to(rt.device, non_blocking=True)  # the copy overlaps queued GPU work
    else:
        t = t.to(rt.device)
    return t[:, :-1], t[:, 1:]


class TrainBatches:
    """Random training windows from a generator of their own, so the order is reproducible
    and resumable. Every rank draws the whole global batch from the same generator and keeps
    its own slice: ranks see disjoint windows and the state to checkpoint is one value."""

    def __init__(self, data, batch_size, block_size, seed, rt):
        self.data, self.batch_size, self.block_size, self.rt = data, batch_size, block_size, rt
        self.rng = np.random.default_rng(seed)

    def __call__(self):
        B, rank = self.batch_size, self.rt.rank
        offsets = self.rng.integers(0, len(self.data) - self.block_size, size=B * self.rt.world_size)
        return get_batch(self.data, offsets[rank * B : (rank + 1) * B], self.block_size, self.rt)


def eval_offsets(data, eval_iters, batch_size, block_size, seed):
    """The fixed (eval_iters, B) window starts evaluated at every eval, so curves compare."""
    return np.random.default_rng(seed).integers(0, len(data) - block_size, size=(eval_iters, batch_size))
