"""Scoring text with a model, batched and without host waits: the losses of the last tokens of
many token rows in one forward pass, whether greedy decoding reproduces them, and per example
the choice with the lowest score. eval.py (HellaSwag, multiple choice) and core_eval.py (CORE)
share it; the sums they keep stay on the device until one read at the end."""

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from batches import to_device


@torch.no_grad()
def row_losses(model, rows, rt, greedy=False):
    """Score token rows [(ids, n), ...]: each row's last n tokens, given the tokens before them.
    All rows are one right-padded forward pass (causal attention never looks at the padding),
    and only the positions that predict scored tokens are un-embedded (logits_at).
    -> on the device, without a host sync: per row the summed loss (R,) float64 and, when
    `greedy`, whether the model's argmax equals every scored token (R,) bool. A row must fit the
    model: at most block_size + 1 tokens (the caller crops)."""
    T, K = max(len(ids) for ids, _ in rows) - 1, max(n for _, n in rows)
    x = np.zeros((len(rows), T), dtype=np.int64)
    at = np.zeros((len(rows), K), dtype=np.int64)  # the positions whose logits predict the scored tokens
    y = np.full((len(rows), K), -1, dtype=np.int64)  # their targets; -1: a row with fewer than K
    for i, (ids, n) in enumerate(rows):
        x[i, : len(ids) - 1] = ids[:-1]
        at[i, :n] = np.arange(len(ids) - 1 - n, len(ids) - 1)
        y[i, :n] = ids[len(ids) - n :]
    x, at, y = (to_device(torch.from_numpy(a), rt) for a in (x, at, y))
    with rt.autocast():
        logits, _ = model(x, logits_at=at)  # (rows, K, vocab)
    # ignore_index, not a boolean mask: indexing by a mask would wait for the GPU to count it
    losses = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-1, reduction="none").view(y.shape)
    totals = losses.sum(1).to(sum_dtype(rt))  # (rows,); an ignored position adds 0
    if not greedy:
        return totals, None
    return totals, ((logits.argmax(-1) == y) | (y < 0)).all(1)


def pick(scores, examples, rt):
    """Per example, whether its lowest score is its answer: `scores` (R,) on the device, rows
    grouped by `examples` [(n_rows, answer), ...] in order (answer -1: a padding example, never
    right) -> (E,) bool on the device. The index tensors are built on the host and copied without a wait."""
    width = max(n for n, _ in examples)
    slot = np.concatenate([e * width + np.arange(n) for e, (n, _) in enumerate(examples)])
    table = torch.full((len(examples) * width,), math.inf, dtype=scores.dtype, device=scores.device)
    table[to_device(torch.from_numpy(slot), rt)] = scores
    answers = to_device(torch.tensor([a for _, a in examples]), rt)
    return table.view(len(examples), width).argmin(1) == answers  # argmin: the first of equal scores, as on the host


def sum_dtype(rt):
    """float64 for the sums, where the device has it (MPS has no float64)."""
    return torch.float32 if rt.device_type == "mps" else torch.float64


def all_reduce(sums, rt):
    """The device sums, added over the ranks, read to the host: the one wait of an evaluation."""
    if rt.ddp:
        dist.all_reduce(sums)
    return sums.cpu()


def progress(iterable, desc, rt):
    """A progress bar on rank 0's terminal (none in a pipe, a log file, or without desc)."""
    if desc is None or not rt.master:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, unit="batch", disable=None, leave=False)


