"""Rollouts and the policy gradient, as nanochat's scripts/chat_rl.py does them: a group of
samples per problem from the chat model, each scored by the task's checker, the group's mean
reward subtracted (the advantage), and a token-level policy gradient on the sampled tokens only.
On policy: no reference model, no KL term, no PPO clip. And pass@k on held-out problems.

    from gpt.rl import rollouts
    groups = [rollouts.rollout(model, template, task, problem, 8, 64, 1.0, None, seed) for ...]
    result = rollouts.policy_step(train_model, optimizer, scaler, groups, lr, grad_clip, rt, world_tokens)

Sampling is sampling.py's KV cache, one problem's group of samples at a time: the samples of a group
share its prompt, so they are a batch of equal lengths, and a generator seeded by (seed, step,
problem) makes a group's samples the same in any process that samples it: a resumed run, and any
number of ranks. serve.py's engine batches requests as they arrive, so what it samples depends
on timing; it is not used here.
"""

import hashlib
import math
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt.inference.sampling import KVCache, sample_next


class Group(NamedTuple):
    prompt: list  # the prompt's ids, up to the assistant's header
    tokens: torch.Tensor  # (G, L) the sampled ids; after a sample's end token, end tokens (not trained)
    lengths: list  # each sample's trained tokens: up to and with its end token, or all L when it never ended
    rewards: list  # each sample's reward, the task's checker
    advantages: torch.Tensor  # (G,) reward - the group's mean reward


def seed_of(*parts):
    """A 63-bit seed from the run's seed and where a draw is (e.g. seed, iter, problem)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def sample(model, prompt, n, max_new_tokens, end_id, temperature, top_k, seed, every_step=False):
    """(n, L) tokens sampled after prompt (ids) by the model (eval mode), L <= max_new_tokens:
    a row that produced end_id goes on with end_id, and sampling stops once every row has (but
    with every_step: FSDP's ranks must run the same number of forward passes)."""
    device = model.lm_head.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(model.config, n, len(prompt) + max_new_tokens)
    logits, _ = model(torch.tensor([prompt] * n, device=device), cache=cache)  # (n, 1, V): the last position's
    done, out = torch.zeros(n, dtype=torch.bool, device=device), []
    for t in range(max_new_tokens):
        next_id = sample_next(logits[:, -1, :].float(), temperature, top_k, 1.0, generator)  # (n, 1)
        next_id = next_id.masked_fill(done[:, None], end_id)
        done |= next_id[:, 0] == end_id
        out.append(next_id)
        if t == max_new_tokens - 1 or (not every_step and bool(done.all())):
            break
        logits, _ = model(next_id, cache=cache)
    return torch.cat(out, dim=1)


def rollout(model, template, task, problem, n, max_new_tokens, temperature, top_k, seed, every_step=False):
    """The Group of n samples of one problem: sampled, scored, and their advantages."""
    prompt = template.render([{"role": "user", "content": problem.prompt}], add_generation_prompt=True)[0]
    tokens = sample(model, prompt, n, max_new_tokens, template.end_id, temperature, top_k, seed, every_step)
    lengths, rewards = [], []
    for row in tokens.tolist():
        length = row.index(template.end_id) + 1 if template.end_id in row else len(row)
        lengths.append(length)
        rewards.append(task.reward(problem, template.decode(row[: length - (row[length - 1] == template.end_id)])))
    r = torch.tensor(rewards)
    return Group(prompt, tokens, lengths, rewards, (r - r.mean()).to(tokens.device))


def sampled_mask(lengths, L, device):
    """(G, L) float: 1 where a position holds a trained (sampled) token."""
    return (torch.arange(L, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]).float()


def policy_loss(logits, tokens, mask, advantages):
    """-sum of advantage * log p(token) over the sampled tokens. logits (G, L, V): the predictions
    of the L sampled positions; tokens, mask (G, L); advantages (G,). The prompt never enters it:
    its positions predict no sampled token."""
    logp = -F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(), reduction="none").view_as(mask)
    return -(advantages[:, None] * logp * mask).sum()


def policy_step(train_model, optimizer, scaler, groups, lr, grad_clip, rt, world_tokens):
    """One optimizer step on this rank's groups: the policy gradient summed over them, divided by
    world_tokens, the sampled tokens of the whole step (every rank's): the step's loss is a mean
    over tokens, whatever the ranks and groups. Returns (this rank's share of that loss, the
    gradient norm)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # a group with its own peak (Muon's) scales with the schedule
    total = torch.zeros((), device=rt.device)
    scale = rt.world_size / world_tokens  # DDP and FSDP average the ranks' gradients: sum them instead
    for i, g in enumerate(groups):
        G, L = g.tokens.shape
        inputs = torch.cat([torch.tensor([g.prompt] * G, device=rt.device), g.tokens[:, :-1]], dim=1)
        last = i == len(groups) - 1
        with train_model.no_sync() if isinstance(train_model, DDP) and not last else nullcontext():
            with rt.autocast():
                logits, _ = train_model(inputs, logits_at="all")  # (G, P + L - 1, V)
                loss = policy_loss(
                    logits[:, len(g.prompt) - 1 :], g.tokens, sampled_mask(g.lengths, L, rt.device), g.advantages
                )
                loss = loss * scale
            scaler.scale(loss).backward()
        total += loss.detach() / rt.world_size
    scaler.unscale_(optimizer)
    params = [p for p in train_model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
    if hasattr(norm, "full_tensor"):  # FSDP's sharded gradients
        norm = norm.full_tensor()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=not isinstance(train_model, DDP))
    return total, norm


# ---------------------------------------------------------------------------- pass@k


def pass_at_k(n, c, k):
    """The unbiased estimate of pass@k from n samples of which c passed (Chen et al. 2021): the
    chance that k samples drawn from the n without replacement hold at least one pass."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate(model, template, task, problems, k, max_new_tokens, temperature, top_k, seed, rt, every_step=False):
    """{'pass@1': ..., 'pass@k': ...} over problems (every rank's share: problem i is rank i %
    world_size's), k samples each, drawn with the same seeds at every evaluation."""
    sums = torch.zeros(k + 1, dtype=torch.float64)  # pass@1..k summed, and the problems counted
    for i in range(rt.rank, len(problems), rt.world_size):
        g = rollout(
            model,
            template,
            task,
            problems[i],
            k,
            max_new_tokens,
            temperature,
            top_k,
            seed_of(seed, "eval", i),
            every_step,
        )
        passed = int(sum(r > 0 for r in g.rewards))
        sums += torch.tensor([pass_at_k(k, passed, j) for j in range(1, k + 1)] + [1.0], dtype=torch.float64)
    if rt.ddp:
        sums = sums.to(rt.device)
        dist.all_reduce(sums)
        sums = sums.cpu()
    return {f"pass@{j}": (sums[j - 1] / sums[k]).item() for j in range(1, k + 1)}
