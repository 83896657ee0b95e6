"""One optimizer step over a batch (gradient accumulation, clipping, skipping non-finite
steps) and the eval loss on fixed windows: the two things the loop does with the model.

    result = train_step(model, optimizer, scaler, batches, lr, accum_steps, grad_clip, rt)
    losses = evaluate(model, {"val": (val_data, offsets)}, block_size, rt)
"""

from contextlib import nullcontext
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import UserError
from gpt.data.batches import IGNORE, eval_batch


class StepResult(NamedTuple):
    loss: torch.Tensor  # this rank's mean loss over the micro-steps (on the device: reading it syncs)
    grad_norm: torch.Tensor  # global gradient norm before clipping (the same on every rank)
    stepped: torch.Tensor  # () bool on the device; False: the step was non-finite and did not touch the weights


def train_step(model, optimizer, scaler, next_batch, lr, accum_steps, grad_clip, rt):
    """One optimizer step over accum_steps micro-batches. A step whose gradient norm is not
    finite is skipped: the weights and optimizer state stay as they were. Nothing here waits
    for the device (with fused AdamW): the caller reads the results when it logs."""
    for group in optimizer.param_groups:
        # a group with its own peak (e.g. Muon's) scales with the schedule
        group["lr"] = lr * group.get("lr_scale", 1.0)
    total = torch.zeros((), device=rt.device)
    x, y, *more = next_batch()
    for micro in range(accum_steps):
        # chat batches add the weight of their summed loss (batches.ChatBatches); doc_mask batches,
        # each token's document number in its row (a tensor: batches.get_batch)
        weight = [m for m in more if not torch.is_tensor(m)]
        docs = {"docs": m for m in more if torch.is_tensor(m)}
        last = micro == accum_steps - 1
        # DDP all-reduces gradients in backward; only the last micro-step needs it. (FSDP
        # reduce-scatters every micro-step: holding whole gradients would undo its memory saving)
        with model.no_sync() if isinstance(model, DDP) and not last else nullcontext():
            with rt.autocast():
                if weight:
                    _, loss = model(x, y, reduction="sum", loss_only=True)
                    loss = loss * weight[0]
                else:
                    _, loss = model(x, y, loss_only=True, **docs)
                    # each micro-batch's mean loss, scaled so the accumulated gradient is that of the
                    # mean over the whole batch, not the sum
                    loss = loss / accum_steps
            if not last:
                x, y, *more = next_batch()  # gathered while the device still runs the forward pass
            scaler.scale(loss).backward()
        total += loss.detach()
    scaler.unscale_(optimizer)  # clip and check the true gradients, not the fp16-scaled ones
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if grad_clip > 0:
        # a NaN norm makes NaN grads: the step is skipped anyway
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
    # a DTensor, from FSDP's sharded gradients: already reduced, the same on every rank
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    # the gradients are already all-reduced, so every rank takes the same decision
    stepped = torch.isfinite(norm)
    if scaler.is_enabled():
        # fp16: GradScaler skips overflowing steps itself (and lowers the scale); that is routine,
        # so only a non-finite loss counts as a bad step. The loss is this rank's: under torchrun
        # every rank must count the same steps (a rank that stops alone leaves the others waiting
        # in their next collective), so the flag is all-reduced, on the device, with no host sync
        scaler.step(optimizer)
        stepped = torch.isfinite(total)
        if rt.ddp:
            finite = stepped.float()
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            stepped = finite.bool()
    elif getattr(optimizer, "_step_supports_amp_scaling", False):
        # fused AdamW takes GradScaler's found_inf tensor: where it is 1 the kernel leaves weights,
        # moments and step count bit-unchanged, so the skip is decided on the device, with no sync
        optimizer.grad_scale, optimizer.found_inf = None, (~stepped).float()
        optimizer.step()
        del optimizer.grad_scale, optimizer.found_inf
    else:
        # an optimizer without found_inf (e.g. a wrapper around several, as Muon + AdamW): the one
        # host sync left in the step. bool() waits for the queued backward to finish before the
        # update is launched: the device idles for a few kernel launches once per optimizer step
        if bool(stepped):
            optimizer.step()
    scaler.update()
    # DDP's gradients are views into its all-reduce buckets (build.build): zeroed in place, they stay
    # views. Set to None, the next micro-step under no_sync would allocate a second set beside the buckets
    optimizer.zero_grad(set_to_none=not isinstance(model, DDP))
    return StepResult(total, norm, stepped)


@torch.no_grad()
def evaluate(model, splits, block_size, rt, group=1):
    """Mean loss on each split's fixed batches; {name: (data, offsets)} -> {name: loss}: the mean
    over every target of every batch (chat data: over the trained tokens). `group` batches go
    through the model together (small models run much faster on bigger matmuls). Under torchrun
    the batches are shared out between the ranks and the sums all-reduced.

    Every forward has the same shape, on every rank: a rank's batches are topped up to the same
    number of whole groups with copies of a batch whose targets are all -1, which add nothing to
    the sums. So a compiled model adds one eval graph, and under FSDP (where every forward is a
    collective) the ranks run as many forwards as each other."""
    model.eval()
    losses = {}
    for name, (data, offsets) in splits.items():
        slots = -(-len(offsets) // rt.world_size)  # batches per rank, rounded up...
        slots = -(-slots // group) * group  # ...and up to whole groups
        mine = offsets[rt.rank :: rt.world_size]  # (n, B), n <= slots
        padded = np.concatenate([mine, np.repeat(offsets[:1], slots - len(mine), axis=0)])
        total = torch.zeros(2, device=rt.device)  # (sum of the token losses, number of targets)
        for i in range(0, slots, group):
            x, y, _ = eval_batch(data, padded[i : i + group].reshape(-1), block_size, rt)
            real = max(0, min(group, len(mine) - i)) * offsets.shape[1]  # rows that are real batches
            if real < len(y):
                y = y.clone()  # a view of the same ids as x
                y[real:] = IGNORE
            with rt.autocast():
                _, loss = model(x, y, reduction="sum", loss_only=True)
            total[0] += loss.float()
            total[1] += (y != IGNORE).sum()
        if rt.ddp:
            dist.all_reduce(total)
        losses[name] = (total[0] / total[1]).item()
    model.train()
    return losses


def eval_group(cfg, padded_vocab_size, world_size=1, budget_bytes=64 * 2**20):
    """How many eval batches go through the model at once: as few forwards per rank as fit their
    float32 logits (the largest tensor of an eval forward) under `budget_bytes`, then the smallest
    group that needs no more of them, so the padding (evaluate) is less than one batch a forward;
    1 for GPT-2-sized vocabularies and contexts."""
    per_rank = -(-cfg.eval_iters // world_size)
    logits_bytes = cfg.batch_size * cfg.block_size * padded_vocab_size * 4
    fits = max(1, min(per_rank, budget_bytes // logits_bytes))
    forwards = -(-per_rank // fits)
    return -(-per_rank // forwards)


class BadSteps:
    """Non-finite steps, counted on the device (three tiny kernels per step, so the step queues up
    behind the last one) and read only where the loop waits for the device anyway (log, eval,
    save): skipped since the last read, in a row now, and the longest run since the last read."""

    def __init__(self, device):
        self.skipped, self.in_a_row, self.worst = (torch.zeros((), dtype=torch.long, device=device) for _ in range(3))

    def record(self, stepped):
        self.in_a_row.add_(1).mul_(~stepped)  # +1, or back to 0 after a good step
        torch.maximum(self.worst, self.in_a_row, out=self.worst)
        self.skipped.add_(~stepped)

    def read(self):
        """(skipped since the last read, in a row now, longest run since the last read); starts a new count."""
        skipped, in_a_row, worst = torch.stack(
            [self.skipped, self.in_a_row, self.worst]
        ).tolist()  # one read of all three
        self.skipped.zero_()
        self.worst.copy_(self.in_a_row)
        return skipped, in_a_row, worst

    def check(self, it, max_bad_steps, saver, say=print):
        """Report the steps skipped since the last check; stop (Diverged) when max_bad_steps came in
        a row. The weights never saw those steps, so the last checkpoint, written before or after
        them, is good."""
        skipped, in_a_row, worst = self.read()
        if skipped:
            say(
                f"iter {it}: non-finite loss or gradient norm, {skipped} step(s) skipped since the last log "
                f"({in_a_row} in a row)"
            )
        if worst >= max_bad_steps:
            saver.wait()  # a save in flight holds good weights: let it complete
            raise Diverged(
                f"{worst} steps in a row had a non-finite loss or gradient norm (max_bad_steps="
                f"{max_bad_steps}); {saver.latest} is the last good checkpoint: lower "
                f"learning_rate or check the data, then --init_from=resume"
            )


class Diverged(UserError):
    exit_code = 3  # train.py's exit code when the loss or gradients stay non-finite
