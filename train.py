"""Train a GPT, on one device or many.

    python train.py config/train_shakespeare_char.py
    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --max_iters=2000
    python train.py config/train_shakespeare_char.py --init_from=resume      # continue where it stopped
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py   # DDP on one node
    python train.py --help                                                   # every key

The pieces (get_lr, TrainBatches, train_step, evaluate) are importable; bench.py and
the tests use them. main() wires them into the loop.
"""

import dataclasses
import glob
import json
import math
import os
import textwrap
import time
import signal
import warnings
from contextlib import nullcontext
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import eval as evals
import hf
import optim
import runtime
import tokenizer
from configurator import TrainConfig, UserError, as_dict, parse, run_main
from data import tokens
from model import GPT, GPTConfig

EXIT_STOPPED = 75  # stopped early (SIGTERM, SIGINT, max_minutes) with a checkpoint: resume to go on

# keys that fix the shapes of the weights: a checkpoint only resumes under the same values
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "pos_encoding", "rope_theta", "norm",
              "mlp", "mlp_hidden", "n_kv_head", "qk_norm", "tie_embeddings", "rope_scaling", "norm_eps")


# ---------------------------------------------------------------------------- data


def load_split(data_dir, split, mode="auto", share=1):
    """A split's token ids (data/tokens.py: one file or many shards, read as one sequence):
    memory-mapped, or read into RAM when mode='ram' or ('auto' and the files are small against
    free memory, split `share` ways between the ranks on this machine)."""
    data = tokens.Tokens.open(data_dir, split)
    if mode == "ram" or (mode == "auto" and data.nbytes * share < _free_memory() / 4):
        data = data.in_ram()  # random windows from RAM avoid page faults on every batch
    return data


def _free_memory():
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0  # unknown: stay with the memmap


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


# ---------------------------------------------------------------------------- optimization


def get_lr(it, cfg):
    """Linear warmup to learning_rate; then cosine decay to min_lr at lr_decay_iters, then flat;
    or (lr_schedule='wsd') warmup-stable-decay: learning_rate until the last decay_frac of
    max_iters, then a straight line down to min_lr at max_iters. The stable phase does not
    depend on max_iters, so a run resumed there with a larger max_iters continues exactly.
    The decay is linear: in Hagele et al. 2024 (arXiv:2405.18392) a linear cooldown matched
    a full cosine run's loss, and a cosine-shaped one did no better."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if cfg.lr_schedule == "wsd":
        decay_start = max(cfg.warmup_iters, (1 - cfg.decay_frac) * cfg.max_iters)  # never inside the warmup
        if it < decay_start:
            return cfg.learning_rate
        if it >= cfg.max_iters:
            return cfg.min_lr
        progress = (it - decay_start) / (cfg.max_iters - decay_start)
        return cfg.learning_rate + progress * (cfg.min_lr - cfg.learning_rate)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


class StepResult(NamedTuple):
    loss: torch.Tensor  # this rank's mean loss over the micro-steps (on the device: reading it syncs)
    grad_norm: torch.Tensor  # global gradient norm before clipping (the same on every rank)
    stepped: torch.Tensor  # () bool on the device; False: the step was non-finite and did not touch the weights


def train_step(model, optimizer, scaler, next_batch, lr, accum_steps, grad_clip, rt, poison=False):
    """One optimizer step over accum_steps micro-batches. A step whose gradient norm is not
    finite is skipped: the weights and optimizer state stay as they were. Nothing here waits
    for the device (with fused AdamW): the caller reads the results when it logs. (`poison`
    turns the loss into NaN, for the tests of that path.)"""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # a group with its own peak (e.g. Muon's) scales with the schedule
    total = torch.zeros((), device=rt.device)
    x, y = next_batch()
    for micro in range(accum_steps):
        last = micro == accum_steps - 1
        # DDP all-reduces gradients in backward; only the last micro-step needs it. (FSDP
        # reduce-scatters every micro-step: holding whole gradients would undo its memory saving)
        with model.no_sync() if isinstance(model, DDP) and not last else nullcontext():
            with rt.autocast():
                _, loss = model(x, y)
            # each micro-batch's mean loss, scaled so the accumulated gradient is that of the mean
            # over the whole batch, not the sum
            loss = loss / accum_steps
            if poison:
                loss = loss * float("nan")
            if not last:
                x, y = next_batch()  # gathered while the device still runs the forward pass
            scaler.scale(loss).backward()
        total += loss.detach()
    scaler.unscale_(optimizer)  # clip and check the true gradients, not the fp16-scaled ones
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)  # a NaN norm makes NaN grads: the step is skipped anyway
    if hasattr(norm, "full_tensor"):  # a DTensor, from FSDP's sharded gradients: already reduced, the same on every rank
        norm = norm.full_tensor()
    # the gradients are already all-reduced, so every rank takes the same decision
    stepped = torch.isfinite(norm)
    if scaler.is_enabled():
        # fp16: GradScaler skips overflowing steps itself (and lowers the scale); that is routine,
        # so only a non-finite loss counts as a bad step
        scaler.step(optimizer)
        stepped = torch.isfinite(total)
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
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total, norm, stepped)


@torch.no_grad()
def evaluate(model, splits, block_size, rt, group=1):
    """Mean loss on each split's fixed batches; {name: (data, offsets)} -> {name: loss}.
    `group` batches go through the model together (the batches are equal-sized, so the mean is
    the same; small models run much faster on bigger matmuls). Under DDP the batches are shared
    out between the ranks and the sums all-reduced."""
    model.eval()
    losses = {}
    for name, (data, offsets) in splits.items():
        mine = offsets[rt.rank :: rt.world_size]  # (n, B)
        total = torch.zeros(2, device=rt.device)  # (sum of batch losses, number of batches)
        for i in range(0, len(mine), group):
            chunk = mine[i : i + group]
            x, y = get_batch(data, chunk.reshape(-1), block_size, rt)
            with rt.autocast():
                _, loss = model(x, y)
            total[0] += loss.float() * len(chunk)
            total[1] += len(chunk)
        if rt.ddp:
            dist.all_reduce(total)
        losses[name] = (total[0] / total[1]).item()
    model.train()
    return losses


def eval_group(cfg, padded_vocab_size, budget_bytes=64 * 2**20):
    """How many eval batches fit in one forward pass with their float32 logits (the largest
    tensor of an eval forward) under `budget_bytes`; 1 for GPT-2-sized vocabularies and contexts."""
    logits_bytes = cfg.batch_size * cfg.block_size * padded_vocab_size * 4
    fits = max(1, min(cfg.eval_iters, budget_bytes // logits_bytes))
    # a divisor of eval_iters, so every forward has the same shape: a compiled model then adds
    # one eval graph, not a second one for a shorter last group
    return max(g for g in range(1, fits + 1) if cfg.eval_iters % g == 0)


MODEL_KEYS = tuple(k for k in SHAPE_KEYS if k != "vocab_size") + ("dropout",)  # GPTConfig's keys that TrainConfig has


def make_model_args(cfg, vocab_size):
    return {**{k: getattr(cfg, k) for k in MODEL_KEYS}, "vocab_size": vocab_size}


def build(raw_model, cfg, rt, state=None):
    """The optimizer and GradScaler for raw_model, the weights and their state restored from a
    checkpoint `state` when resuming, and the two forms the loop calls: `model` (compiled when
    asked; evaluation uses it) and `train_model` (also DDP-wrapped under torchrun). With
    parallelism='fsdp' under torchrun, raw_model itself is sharded in place instead."""
    raw_model.activation_checkpointing = cfg.activation_checkpointing
    fsdp = uses_fsdp(cfg, rt)
    if fsdp:
        shard(raw_model, rt)  # before the optimizer is made: it must hold the sharded parameters
    elif cfg.parallelism == "fsdp" and rt.master:
        print("note: parallelism='fsdp' in a single process has nothing to shard over; training unsharded")
    optimizer = optim.configure(raw_model, cfg, rt.device_type)
    scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.dtype == torch.float16)  # loss scaling only for fp16
    if state is not None:
        checkpoint.restore(state, raw_model, optimizer, scaler, fsdp)
    error = raw_model.attention_error(cfg.attention, rt.device, rt.dtype)
    if error:
        raise UserError(f"attention='{cfg.attention}' cannot run on {rt.device} in {str(rt.dtype).removeprefix('torch.')} "
                        f"for this model ({error}); use --attention=auto")
    raw_model.set_attention(cfg.attention)
    # static shapes: the training step has one shape, and eval one more (eval_group keeps it to one)
    model = torch.compile(raw_model, dynamic=False) if cfg.compile else raw_model
    train_model = DDP(model, device_ids=[rt.local_rank] if rt.device_type == "cuda" else None) if rt.ddp and not fsdp else model
    return model, train_model, optimizer, scaler


def uses_fsdp(cfg, rt):
    return rt.ddp and cfg.parallelism == "fsdp"


def shard(raw_model, rt):
    """FSDP2: every parameter, its gradient and its AdamW state split over the ranks. Each block
    is one unit, gathered whole just before its forward and backward and freed after; the root
    unit holds the rest (embeddings, lm_head, ln_f)."""
    # imported here: torch.distributed's FSDP and DTensor modules take ~1 s to import
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for t in raw_model.state_dict().values():  # ranks init with their own seeds: take rank 0's weights, as DDP does
        dist.broadcast(t, src=0)
    mesh = init_device_mesh(rt.device_type, (rt.world_size,))
    # bf16/fp16 runs gather the weights in that dtype (half the traffic and memory) and reduce
    # the gradients in fp32; the fp32 shards are what AdamW updates. train_step's autocast stays
    # on, so norms, softmax and the loss run in fp32 as they do under DDP.
    policy = MixedPrecisionPolicy(param_dtype=rt.dtype, reduce_dtype=torch.float32)
    # FSDP warns that the root returns a view (the logits cut to the real vocabulary); harmless
    # here, since nothing modifies the logits in place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for block in raw_model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(raw_model, mesh=mesh, mp_policy=policy)


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
        budget, source = _free_memory() / 2, "half the free RAM"
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


# ---------------------------------------------------------------------------- checkpoints and logs


def check_resumable(saved, wanted):
    # through GPTConfig: a key older checkpoints lack takes its default, as it had then, and
    # "0 means the usual" keys compare by the sizes they stand for
    saved_cfg, wanted_cfg = GPTConfig(**saved), GPTConfig(**wanted)
    differ = [f"{k} {getattr(saved_cfg, k)} -> {getattr(wanted_cfg, k)}" for k in SHAPE_KEYS
              if getattr(saved_cfg, k) != getattr(wanted_cfg, k)]
    if differ:
        raise UserError(f"cannot resume: the checkpoint's model differs in {', '.join(differ)}; use the config it was trained with")


class MetricsLog:
    """out_dir/metrics.jsonl, one JSON object per line; wandb and TensorBoard, when asked
    for, are fed the same records. On resume, records past the checkpoint are dropped from
    all three, since the resumed run logs those steps again."""

    def __init__(self, out_dir, resume_iter, cfg, wandb_run_id=None):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        if resume_iter is None:
            open(self.path, "w").close()
        else:
            self._truncate(resume_iter)
        self.wandb = self.tensorboard = self.wandb_run_id = None
        if cfg.wandb_log:
            import wandb  # optional dependencies, imported only when asked for

            # the run id travels in the checkpoint, so a resumed run continues the same wandb run
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=as_dict(cfg),
                                    id=wandb_run_id, resume="allow", dir=out_dir)
            self.wandb_run_id = self.wandb.id
        if cfg.tensorboard_log:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a run that died after its last checkpoint wrote past it
            self.tensorboard = SummaryWriter(os.path.join(out_dir, "tensorboard"),
                                             purge_step=None if resume_iter is None else resume_iter + 1)

    def _truncate(self, resume_iter):
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        keep = [r for r in records if r["iter"] < resume_iter or ("loss" not in r and r["iter"] == resume_iter)]  # its evals
        with open(self.path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
        os.replace(self.path + ".tmp", self.path)

    def write(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")  # json keeps every digit of a float
        values = {k: v for k, v in record.items() if k != "iter" and v is not None}
        if self.wandb is not None:
            self.wandb.log(values, step=record["iter"])
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, record["iter"])
            self.tensorboard.flush()  # a preempted run keeps what it logged


class Diverged(UserError):
    exit_code = 3


class StopRequest:
    """SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C) only set a flag; the loop
    reads it between steps, writes a checkpoint and exits. A second Ctrl-C quits at once."""

    def __init__(self, max_minutes=0.0):
        self.reason, self.group = None, None
        self.deadline = time.monotonic() + 60 * max_minutes if max_minutes > 0 else None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name

    def check(self, rt):
        """True when this process should stop now; under DDP, when any rank should, so all agree."""
        if self.reason is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.reason = "max_minutes"
        stop = self.reason is not None
        if rt.ddp:
            # every step, so the flag travels on the host: over gloo (a group of its own when NCCL
            # carries the gradients) the ranks wait for each other, never for their GPUs
            if self.group is None:
                self.group = dist.new_group(backend="gloo") if rt.device_type == "cuda" else dist.group.WORLD
            flag = torch.tensor(float(stop))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            stop = bool(flag.item())
        return stop

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def format_duration(seconds):
    seconds = int(seconds)
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# ---------------------------------------------------------------------------- main


def main(argv=None):
    cfg = parse(TrainConfig, argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # checked before joining the process group
    if cfg.batch_size != "auto" and cfg.gradient_accumulation_steps % world_size:
        raise UserError(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} does not divide among "
            f"{world_size} processes; make it a multiple of {world_size}"
        )
    if cfg.parallelism == "fsdp" and cfg.eval_iters % world_size:  # under FSDP every forward is a collective
        raise UserError(f"eval_iters={cfg.eval_iters}: with parallelism='fsdp' each of the {world_size} ranks must "
                        f"evaluate as many batches as the others; make it a multiple of {world_size}")
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.backend)
    stop = StopRequest(cfg.max_minutes)
    finished = False
    try:
        code = train(cfg, rt, stop)
        finished = True
        return code
    finally:
        stop.restore()
        runtime.teardown(rt, all_finished=finished)


def train(cfg, rt, stop):
    """The training loop; returns the process exit code (0, or EXIT_STOPPED)."""
    torch.manual_seed(cfg.seed + rt.rank)
    say = print if rt.master else (lambda message: None)  # notes from the pieces below: rank 0 prints them

    # data and tokenizer
    data_dir = os.path.join("data", cfg.dataset)  # an absolute dataset path is used as it is
    share = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    train_data = load_split(data_dir, "train", cfg.data_mode, share)
    val_data = load_split(data_dir, "val", cfg.data_mode, share)
    tok_spec = tokenizer.describe(data_dir)
    model_args = make_model_args(cfg, tokenizer.vocab_size(tok_spec) or 50304)  # no meta: GPT-2 padded, as nanoGPT did
    for name, data in (("train", train_data), ("val", val_data)):
        if len(data) <= cfg.block_size:
            where = data.paths[0] if len(data.paths) == 1 else os.path.join(data_dir, f"{name}_*.bin")
            raise UserError(f"block_size={cfg.block_size} is longer than {where} ({len(data)} tokens); lower block_size")
        data.check_vocab(model_args["vocab_size"])  # an id past the embedding table would fail mid-run, or worse on GPU
    test_data = None
    if glob.glob(os.path.join(glob.escape(data_dir), "test*.bin")):  # scored once, at the end
        test_data = load_split(data_dir, "test", cfg.data_mode, share)
        if len(test_data) <= cfg.block_size:
            say(f"note: the test split ({len(test_data)} tokens) is shorter than block_size; it is not evaluated")
            test_data = None
        else:
            test_data.check_vocab(model_args["vocab_size"])
    # HellaSwag's examples are read and tokenized once, before training: a bad file or a
    # character-level tokenizer is refused now, not at the first interval
    hellaswag = evals.encode_examples(evals.load_hellaswag(cfg.hellaswag_path, cfg.hellaswag_examples), tok_spec) \
        if cfg.hellaswag_interval else None

    state = None
    if cfg.init_from == "resume":
        state = checkpoint.load_newest(cfg.out_dir, report=say)
        trained_with = {**as_dict(TrainConfig()), **state["config"]}  # a key an older checkpoint lacks had its default
        if all(trained_with[k] == getattr(cfg, k) for k in SHAPE_KEYS if hasattr(cfg, k)):
            # the config it was trained with: the model is the checkpoint's, also when GPT-2's
            # weights (init_from='gpt2...') gave it a shape other than these keys say
            model_args = {**state["model_args"], "dropout": cfg.dropout}
        check_resumable(state["model_args"], model_args)
        if trained_with["optimizer"] != cfg.optimizer:
            raise UserError(f"cannot resume: the checkpoint was trained with optimizer={trained_with['optimizer']!r}, whose "
                            f"state this run's optimizer={cfg.optimizer!r} cannot take; resume with --optimizer={trained_with['optimizer']}")

    if cfg.init_from in ("scratch", "resume"):
        raw_model = GPT(GPTConfig(**model_args)).to(rt.device)
    else:  # GPT-2's weights by name, or a Hugging Face GPT-2 or Llama directory; they fix the model's shape
        raw_model, model_args = hf.load_for_training(cfg, tok_spec, report=say)
        raw_model = raw_model.to(rt.device)
    if cfg.batch_size == "auto":
        # a resumed run keeps the micro-batch it started with, so its data order stays the same
        batch_size = state["config"]["batch_size"] if state is not None else auto_batch_size(raw_model, cfg, rt)
        cfg = with_batch_size(cfg, batch_size, cfg.total_batch_size)
    accum_steps = cfg.gradient_accumulation_steps // rt.world_size
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    model, train_model, optimizer, scaler = build(raw_model, cfg, rt, state)
    batches = TrainBatches(train_data, cfg.batch_size, cfg.block_size, cfg.seed, rt)
    iter_num, best_val_loss, wandb_run_id = 0, float("inf"), None
    if state is not None:
        checkpoint.restore_rng(state, batches, rt)
        iter_num, best_val_loss, wandb_run_id = state["iter_num"], state["best_val_loss"], state.get("wandb_run_id")
        del state  # free the host copy of the weights
    eval_splits = {
        split: (data, eval_offsets(data, cfg.eval_iters, cfg.batch_size, cfg.block_size, cfg.seed + i + 1))
        for i, (split, data) in enumerate((("train", train_data), ("val", val_data), ("test", test_data))) if data is not None
    }
    # bits per byte: the eval windows are fixed, so the bytes of their targets' text are counted once, on the host
    token_bytes = tokenizer.token_bytes(tok_spec)
    eval_bytes = {split: evals.target_bytes(data, offsets, cfg.block_size, token_bytes)
                  for split, (data, offsets) in eval_splits.items() if split != "train"}
    eval_tokens = cfg.eval_iters * cfg.batch_size * cfg.block_size

    metrics = None
    if rt.master:
        _prepare_out_dir(cfg)
        metrics = MetricsLog(cfg.out_dir, iter_num if cfg.init_from == "resume" else None, cfg, wandb_run_id)
        print(textwrap.fill("config: " + " ".join(f"{k}={v!r}" for k, v in as_dict(cfg).items()), 120, subsequent_indent="  "))
        print(
            f"{raw_model.num_params() / 1e6:.2f}M parameters | {tokens_per_iter:,} tokens/iter "
            f"({rt.world_size} rank(s) x {accum_steps} micro-steps x {cfg.batch_size} x {cfg.block_size}) | "
            f"{rt.device} {str(rt.dtype).removeprefix('torch.')}"
            + (f" | resuming at iter {iter_num}" if cfg.init_from == "resume" else "")
        )

    flops_per_iter = raw_model.flops_per_token() * tokens_per_iter
    peak = runtime.device_peak_flops(rt, cfg.peak_flops)
    resumed_at = iter_num if cfg.init_from == "resume" else None
    window_start, window_iters, warm = None, 0, False
    # non-finite steps, counted on the device and read where the loop waits for it anyway (log,
    # eval, save): skipped since the last read, in a row now, and the longest run since the last read
    skipped, bad_in_a_row, worst_run = (torch.zeros((), dtype=torch.long, device=rt.device) for _ in range(3))
    nan_iters = {int(i) for i in os.environ.get("TRAIN_TEST_NAN_ITERS", "").split(",") if i}  # test-only fault injection

    fmt = cfg.checkpoint_format if cfg.checkpoint_format != "auto" else "sharded" if uses_fsdp(cfg, rt) else "full"
    saver = checkpoint.Checkpointer(cfg.out_dir, fmt, cfg.keep_last, cfg.async_checkpoint, rt)

    def save(best=False):
        """A checkpoint of this step (the keep_last history, ckpt_best when best), written now or in the background."""
        info = {"model_args": model_args, "config": as_dict(cfg), "tokenizer": tok_spec, "iter_num": iter_num,
                "best_val_loss": best_val_loss, "wandb_run_id": metrics.wandb_run_id if rt.master else None}
        saver.save(raw_model, optimizer, scaler, uses_fsdp(cfg, rt), info, batches, best)

    def check_bad_steps():
        """Report the steps skipped since the last check; stop (exit 3) when max_bad_steps came in a row.
        The weights never saw those steps, so ckpt.pt, written before or after them, is good."""
        n_skipped, worst, in_a_row = torch.stack([skipped, worst_run, bad_in_a_row]).tolist()  # one read of all three
        if n_skipped and rt.master:
            print(f"iter {iter_num}: non-finite loss or gradient norm, {n_skipped} step(s) skipped since the last log "
                  f"({in_a_row} in a row)")
        skipped.zero_()
        worst_run.copy_(bad_in_a_row)
        if worst >= cfg.max_bad_steps:
            saver.wait()  # a save in flight holds good weights: let it complete
            raise Diverged(f"{worst} steps in a row had a non-finite loss or gradient norm (max_bad_steps="
                           f"{cfg.max_bad_steps}); {saver.latest} is the last good checkpoint: lower "
                           f"learning_rate or check the data, then --init_from=resume")

    # The loop runs once more after the last step, so the final eval and save live in one place.
    while True:
        last = iter_num >= cfg.max_iters
        saved_now = False
        saver.poll()  # a background save that finished is committed here; one that failed stops the run
        evaluating = cfg.eval_only or ((iter_num % cfg.eval_interval == 0 or last) and iter_num != resumed_at)
        if evaluating or last:
            check_bad_steps()  # before a checkpoint can be written
        if hellaswag is not None and (cfg.eval_only or (iter_num % cfg.hellaswag_interval == 0 or last) and iter_num != resumed_at):
            # the plain model: the padded lengths vary, which a compiled one would recompile for
            scores = evals.score_choices(raw_model, hellaswag, cfg.block_size, rt, cfg.batch_size)
            if rt.master:
                print(f"step {iter_num}: hellaswag acc {scores['acc']:.4f}, acc_norm {scores['acc_norm']:.4f} ({scores['n']} examples)")
                metrics.write({"iter": iter_num, "hellaswag_acc": scores["acc"], "hellaswag_acc_norm": scores["acc_norm"]})
            window_start = None
        if evaluating:
            final = last or cfg.eval_only  # the test split is scored once, at the end
            splits = {k: v for k, v in eval_splits.items() if k != "test" or final}
            losses = evaluate(model, splits, cfg.block_size, rt, eval_group(cfg, raw_model.config.padded_vocab_size))
            bpb = {k: evals.bits_per_byte(losses[k], eval_tokens, eval_bytes[k]) for k in losses if k != "train"}
            if rt.master:
                print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} ({bpb['val']:.4f} bpb)"
                      + (f", test loss {losses['test']:.4f} ({bpb['test']:.4f} bpb)" if "test" in losses else ""))
                metrics.write({"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
                               **({"test_loss": losses["test"]} if "test" in losses else {}),
                               **{f"{k}_bpb": v for k, v in bpb.items()}})
            if cfg.eval_only:
                return 0
            improved = losses["val"] < best_val_loss
            best_val_loss = min(best_val_loss, losses["val"])
            if iter_num > 0 and (improved or cfg.always_save_checkpoint):
                save(best=improved)
                saved_now = True
            window_start = None  # evaluation time is not training time
        if last:
            if not saved_now and iter_num != resumed_at:
                save()
            saver.wait()
            break
        if stop.check(rt):
            check_bad_steps()
            if not saved_now and iter_num != resumed_at:
                save()
            saver.wait()
            if rt.master:
                print(f"stopped at iter {iter_num} ({stop.reason or 'another rank'}); {saver.latest} is current: "
                      f"continue with --init_from=resume")
            return EXIT_STOPPED

        if window_start is None:
            runtime.synchronize(rt)
            window_start, window_iters = time.perf_counter(), 0
        lr = get_lr(iter_num, cfg)
        ratio_due = rt.master and cfg.update_ratio_interval > 0 and iter_num % cfg.update_ratio_interval == 0
        before = optim.snapshot(raw_model) if ratio_due else None  # the N-th step only: off the hot path
        loss, grad_norm, stepped = train_step(train_model, optimizer, scaler, batches, lr, accum_steps, cfg.grad_clip, rt,
                                              poison=iter_num in nan_iters)
        if ratio_due:
            metrics.write({"iter": iter_num, **optim.update_ratios(raw_model, before)})
        # device-side bookkeeping (three tiny kernels), so the step queues up behind the last one
        bad_in_a_row.add_(1).mul_(~stepped)  # +1, or back to 0 after a good step
        torch.maximum(worst_run, bad_in_a_row, out=worst_run)
        skipped.add_(~stepped)
        window_iters += 1
        if iter_num % cfg.log_interval == 0:
            check_bad_steps()
            if rt.ddp:
                dist.all_reduce(loss)
                loss = loss / rt.world_size
            loss_value, norm_value = torch.stack([loss, grad_norm.float()]).tolist()  # waits for the device: the window's time below is real
            clipped = cfg.grad_clip > 0 and norm_value > cfg.grad_clip
            runtime.synchronize(rt)
            now = time.perf_counter()
            dt = (now - window_start) / window_iters
            # the first window of a process holds compilation and allocator warm-up: no MFU from it
            mfu = runtime.mfu(flops_per_iter, dt, peak, rt.world_size) if warm else None
            warm, window_start, window_iters = True, now, 0
            if rt.master:
                eta = format_duration(dt * (cfg.max_iters - iter_num - 1))
                mfu_text = f"{mfu:.1%}" if mfu is not None else "n/a"
                print(f"iter {iter_num}: loss {loss_value:.4f}, lr {lr:.2e}, grad norm {norm_value:.3g}{' (clipped)' if clipped else ''}, "
                      f"{dt * 1000:.1f} ms/iter, "
                      f"{tokens_per_iter / dt:,.0f} tok/s, {flops_per_iter / dt / 1e12 / rt.world_size:.3g} TFLOPS/device, "
                      f"mfu {mfu_text}, eta {eta}")
                metrics.write({"iter": iter_num, "loss": loss_value, "lr": lr, "grad_norm": norm_value, "clipped": clipped,
                               "dt_ms": dt * 1000, "tokens_per_s": tokens_per_iter / dt, "mfu": mfu})
        iter_num += 1
    return 0


def _prepare_out_dir(cfg):
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(as_dict(cfg), f, indent=2)
    except OSError as e:
        raise UserError(f"cannot write to out_dir={cfg.out_dir} ({e.strerror}); choose a writable --out_dir")


if __name__ == "__main__":
    run_main(main)
