"""batch_size='auto': the largest micro-batch that fits the device's memory, from the bytes the
weights, gradients and optimizer state take and the bytes one more sequence adds to a step."""

import dataclasses

import torch

from configurator import UserError
from gpt.device import host_memory


def with_batch_size(cfg, batch_size, tokens_per_step):
    """cfg with micro-batch `batch_size` and the gradient accumulation that keeps tokens_per_step."""
    return dataclasses.replace(
        cfg, batch_size=batch_size, gradient_accumulation_steps=tokens_per_step // (batch_size * cfg.block_size)
    )


def saved_activation_bytes(model, block_size, rt, batch_size=1):
    """Bytes autograd keeps for backward after a forward of batch_size sequences of block_size
    tokens: measured by watching what the forward pass saves (each storage once, the weights
    themselves not at all), not modelled. Under autocast that includes the low-precision copy of
    each weight, made once whatever the batch; with activation checkpointing, only the blocks'
    inputs (checkpoint saves them) and what is saved outside the blocks."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    x = torch.zeros(batch_size, block_size, dtype=torch.long, device=rt.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rt.autocast():
        model(x, x)
    return total


def activation_bytes(model, cfg, rt):
    """(bytes per sequence, bytes per step whatever the batch) that a training step holds beyond the
    weights, gradients and AdamW state. Saved tensors are measured at one and two sequences: the
    difference is what a sequence adds, the rest is fixed (autocast's weight copies). With
    activation checkpointing the forward keeps only the blocks' inputs and what lies outside the
    blocks, and backward runs the blocks again one at a time: the one running holds its share of
    the saved tensors without checkpointing (1/n_layer of the blocks' part). Backward also makes the
    logits' gradient (float32 from the loss, then again for the padded rows) while the saved tensors
    are still held: 2 x T x V x 4 bytes a sequence."""

    def saved(checkpointing):
        model.activation_checkpointing = checkpointing
        one, two = (saved_activation_bytes(model, cfg.block_size, rt, b) for b in (1, 2))
        return two - one, 2 * one - two

    was = model.activation_checkpointing
    try:
        # checkpointing frees some weight copies until backward: fixed is an upper bound then
        per_row, fixed = saved(False)
        if cfg.activation_checkpointing:
            kept, _ = saved(True)
            per_row = kept + (per_row - kept) // model.config.n_layer
    finally:
        model.activation_checkpointing = was
    return per_row + 2 * cfg.block_size * model.config.padded_vocab_size * 4, fixed


def gradient_bytes(model):
    """The bytes gradients hold through a step: one float32 gradient per parameter. Under DDP that
    one set is also its all-reduce buckets: the gradients are views into them (build.build's
    gradient_as_bucket_view, kept so by train_step zeroing them in place). Without that, DDP's
    buckets were a second gradient-sized buffer beside the gradients."""
    return 4 * sum(p.numel() for p in model.parameters())


def auto_batch_size(model, cfg, rt, safety=0.85):
    """The largest micro-batch whose weights, gradients, AdamW state and activations (activation_bytes)
    fit in `safety` of the memory budget, among those that divide total_batch_size evenly."""
    if cfg.memory_budget_gb > 0:
        budget, source = cfg.memory_budget_gb * 2**30, "memory_budget_gb"
    elif rt.device_type == "cuda":
        budget, source = torch.cuda.get_device_properties(rt.device).total_memory, "GPU memory"
    else:
        budget, source = host_memory.free_memory() / 2, "half the free RAM"
    if cfg.total_batch_size % (cfg.block_size * rt.world_size):
        raise UserError(
            f"total_batch_size={cfg.total_batch_size} does not split into whole sequences of block_size="
            f"{cfg.block_size} over {rt.world_size} rank(s); make it a multiple of {cfg.block_size * rt.world_size}"
        )
    per_row, step_fixed = activation_bytes(model, cfg, rt)
    n_params = sum(p.numel() for p in model.parameters())
    # fp32 weights, grads, Adam m and v; autocast copies
    fixed = 4 * n_params + gradient_bytes(model) + 8 * n_params + step_fixed
    rows_per_rank = cfg.total_batch_size // cfg.block_size // rt.world_size
    fits = int((safety * budget - fixed) // per_row)
    candidates = [b for b in range(min(fits, rows_per_rank), 0, -1) if rows_per_rank % b == 0]
    if not candidates:
        raise UserError(
            f"batch_size='auto': not even one sequence fits in {budget / 2**30:.3g} GB ({source}) with "
            f"total_batch_size={cfg.total_batch_size} over {rt.world_size} rank(s); raise memory_budget_gb or shrink the model"
        )
    batch_size = candidates[0]
    if rt.master:
        print(
            f"batch_size=auto: {batch_size} ({fixed / 2**30:.3g} GB weights+grads+AdamW+autocast copies, {per_row / 2**20:.1f} MB "
            f"activations and logits' gradient per sequence, {safety:.0%} of {budget / 2**30:.3g} GB {source}); "
            f"gradient_accumulation_steps={cfg.total_batch_size // (batch_size * cfg.block_size)} keeps "
            f"{cfg.total_batch_size:,} tokens per step"
        )
    return batch_size


def settle_batch_size(cfg, model, rt, state=None):
    """cfg with batch_size='auto' made a number: a resumed run's (the checkpoint `state`'s), so its
    data order stays the same, or the largest that fits (auto_batch_size). A number stays as it is."""
    if cfg.batch_size != "auto":
        return cfg
    batch_size = state["config"]["batch_size"] if state is not None else auto_batch_size(model, cfg, rt)
    return with_batch_size(cfg, batch_size, cfg.total_batch_size)
