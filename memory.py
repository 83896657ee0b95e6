"""batch_size='auto': the largest micro-batch that fits the device's memory, from the bytes the
weights, gradients and optimizer state take and the bytes one sequence's activations take."""

import dataclasses

import torch

import runtime
from configurator import UserError


def with_batch_size(cfg, batch_size, tokens_per_step):
    """cfg with micro-batch `batch_size` and the gradient accumulation that keeps tokens_per_step."""
    return dataclasses.replace(cfg, batch_size=batch_size, gradient_accumulation_steps=tokens_per_step // (batch_size * cfg.block_size))


def saved_activation_bytes(model, block_size, rt):
    """Bytes autograd keeps for backward for one sequence of block_size tokens: measured by
    watching what the forward pass saves (weights excluded), not modelled."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    x = torch.zeros(1, block_size, dtype=torch.long, device=rt.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rt.autocast():
        model(x, x)
    return total


def auto_batch_size(model, cfg, rt, safety=0.85):
    """The largest micro-batch whose weights, gradients, AdamW state and saved activations fit
    in `safety` of the memory budget, among those that divide total_batch_size evenly."""
    if cfg.memory_budget_gb > 0:
        budget, source = cfg.memory_budget_gb * 2**30, "memory_budget_gb"
    elif rt.device_type == "cuda":
        budget, source = torch.cuda.get_device_properties(rt.device).total_memory, "GPU memory"
    else:
        budget, source = runtime.free_memory() / 2, "half the free RAM"
    if cfg.total_batch_size % (cfg.block_size * rt.world_size):
        raise UserError(f"total_batch_size={cfg.total_batch_size} does not split into whole sequences of block_size="
                        f"{cfg.block_size} over {rt.world_size} rank(s); make it a multiple of {cfg.block_size * rt.world_size}")
    fixed = 16 * sum(p.numel() for p in model.parameters())  # fp32 weights, grads, Adam m and v
    per_row = saved_activation_bytes(model, cfg.block_size, rt)
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
        print(f"batch_size=auto: {batch_size} ({fixed / 2**30:.3g} GB weights+grads+AdamW, {per_row / 2**20:.1f} MB "
              f"activations per sequence, {safety:.0%} of {budget / 2**30:.3g} GB {source}); "
              f"gradient_accumulation_steps={cfg.total_batch_size // (batch_size * cfg.block_size)} keeps "
              f"{cfg.total_batch_size:,} tokens per step")
    return batch_size
