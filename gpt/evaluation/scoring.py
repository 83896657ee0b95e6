"""Scoring text with a model, batched and without host waits: the losses of the last tokens of
many token rows in one forward pass, whether greedy decoding reproduces them, and per example
the choice with the lowest score. eval.py (HellaSwag, multiple choice) and core.py (CORE)
share it; the sums they keep stay on the device until one read at the end. And a split's
document-masked loss, the speedruns' val loss (train.py's eval_masked, eval.py's val_masked)."""

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gpt.data.batches import document_windows
from gpt.device.runtime import to_device


@torch.no_grad()
def row_losses(model, rows, rt, greedy=False):
    """Score token rows [(ids, n), ...]: each row's last n tokens, given the tokens before them.
    All rows are one right-padded forward pass (causal attention never looks at the padding),
    and only the positions that predict scored tokens are un-embedded (logits_at).
    -> on the device, without a host sync: per row the summed loss (R,) float64 and, when
    `greedy`, whether the model's argmax equals every scored token (R,) bool. A row must fit the
    model: at most block_size + 1 tokens (the caller crops)."""
    T = max(len(ids) for ids, _ in rows) - 1
    x = np.zeros((len(rows), T), dtype=np.int64)
    for i, (ids, n) in enumerate(rows):
        x[i, : len(ids) - 1] = ids[:-1]
    # each scored token: the flat (B*T) position that predicts it, the token, its row
    at = np.concatenate([i * T + np.arange(len(ids) - 1 - n, len(ids) - 1) for i, (ids, n) in enumerate(rows)])
    y = np.concatenate([ids[len(ids) - n :] for ids, n in rows]).astype(np.int64)
    row = np.repeat(np.arange(len(rows)), [n for _, n in rows])
    x, at, y, row = (to_device(torch.from_numpy(a), rt) for a in (x, at, y, row))
    with rt.autocast():
        logits, _ = model(x, logits_at=at)  # (scored tokens, vocab)
    losses = F.cross_entropy(logits.float(), y, reduction="none")  # in fp32
    totals = torch.zeros(len(rows), dtype=sum_dtype(rt), device=losses.device).index_add_(
        0, row, losses.to(sum_dtype(rt))
    )
    if not greedy:
        return totals, None
    wrong = torch.zeros(len(rows), dtype=torch.long, device=losses.device).index_add_(
        0, row, (logits.argmax(-1) != y).long()
    )
    return totals, wrong == 0


@torch.no_grad()
def masked_loss(model, data, block_size, rt, eot, batch_size=16, desc=None):
    """The speedruns' val loss: a split cut into consecutive windows of block_size tokens (the
    last one short), each token predicted only from the earlier tokens of its own document inside
    its window (a document begins at its end-of-text: model.GPT.forward's docs), and every token
    but the first scored once -> {"loss": the mean over them, "tokens"}. Every forward is
    (batch_size, block_size), on every rank (under FSDP each is a collective): the last batches
    are topped up with windows past the split's end, whose targets are all ignored."""
    starts = np.arange(0, len(data) - 1, block_size)
    per_rank = -(-len(starts) // (rt.world_size * batch_size)) * batch_size
    mine = np.full(per_rank, len(data))
    own = starts[rt.rank :: rt.world_size]
    mine[: len(own)] = own
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=sum_dtype(rt), device=rt.device)
    for b in progress(range(0, per_rank, batch_size), desc, rt):
        x, y, docs = document_windows(data, mine[b : b + batch_size], block_size, rt, eot)
        with rt.autocast():
            _, loss = model(x, y, reduction="sum", docs=docs, loss_only=True)
        total += loss.to(total.dtype)
    model.train(was_training)
    return {"loss": all_reduce(total, rt).item() / (len(data) - 1), "tokens": len(data) - 1}


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
