"""The optimizer train.py steps: nanoGPT's AdamW over every parameter, or Muon (muon.py) for the
blocks' weight matrices with AdamW for the rest; the learning-rate schedule; and the per-layer
update-to-weight ratio for the logs.

Muon is defined for 2-D hidden-layer weights only: the embeddings, lm_head (tied to wte), norm
gains and biases stay with AdamW, as in modded-nanogpt and nanochat.
"""

import math

import torch
import torch.distributed as dist

from gpt.train.muon import Muon


class Optimizers:
    """Several torch optimizers stepped as one. param_groups lists every group of every
    optimizer, so train_step's schedule sets all their learning rates (a group's `lr_scale`
    keeps its own peak as a ratio to learning_rate); the state_dict holds each one's state in
    order, for exact resume. When every one takes GradScaler's protocol (fused AdamW, Muon),
    so do they together: grad_scale and found_inf set on this object reach each one."""

    def __init__(self, optimizers):
        self.optimizers = optimizers
        self._step_supports_amp_scaling = all(getattr(o, "_step_supports_amp_scaling", False) for o in optimizers)

    @property
    def param_groups(self):  # read afresh: load_state_dict replaces each optimizer's group dicts
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self):
        scaling = {k: getattr(self, k) for k in ("grad_scale", "found_inf") if hasattr(self, k)}
        for opt in self.optimizers:
            for k, v in scaling.items():
                setattr(opt, k, v)
            opt.step()
            for k in scaling:
                delattr(opt, k)

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        for opt, state in zip(self.optimizers, state_dict["optimizers"], strict=True):
            scales = [group.get("lr_scale", 1.0) for group in opt.param_groups]
            opt.load_state_dict(state)
            for group, scale in zip(opt.param_groups, scales):
                group["lr_scale"] = scale  # this run's muon_lr, as a resumed run takes this run's learning_rate


def is_muon_param(name, p):
    """The blocks' weight matrices (attention and MLP projections): transformer.h.<i>...weight, 2-D."""
    return name.startswith("transformer.h.") and p.dim() == 2


def configure(model, cfg, device_type):
    """cfg.optimizer='adamw': the model's fused AdamW (nanoGPT's groups); 'muon': Optimizers of
    Muon for the blocks' matrices and that AdamW for every other parameter."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        return model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas, device_type)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_muon_param(n, p)]
    # under torchrun each rank orthogonalizes its share (muon.py); not inside a replica group, whose
    # peers (torchft) read one rank's optimizer state alone, which a shared state_dict cannot serve
    shared = dist.is_available() and dist.is_initialized() and cfg.ft_replica_group < 0
    muon = Muon(
        [{"params": matrices, "lr_scale": cfg.muon_lr / cfg.learning_rate}],
        compile=cfg.compile,
        shared=shared,
        polar_express=cfg.muon_polar_express,
        normuon=cfg.muon_normuon,
        cautious=cfg.muon_cautious_wd,
        lr=cfg.muon_lr,
        momentum=cfg.muon_momentum,
        weight_decay=cfg.muon_weight_decay,
        nesterov=True,
    )
    rest = [p for n, p in named if not is_muon_param(n, p)]
    adamw = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas, device_type, params=rest)
    return Optimizers([muon, adamw])


def layer_of(name):
    """The layer a parameter belongs to, for the logs: 'h.3' for transformer.h.3.attn.c_attn.weight,
    'wte' for transformer.wte.weight, 'lm_head' for an untied lm_head.weight."""
    parts = name.removeprefix("transformer.").split(".")
    return ".".join(parts[:2]) if parts[0] == "h" else parts[0]


def snapshot(model):
    """A copy of every weight, taken before a step whose update ratios will be logged."""
    return [p.detach().clone() for p in model.parameters()]


def update_ratios(model, before):
    """{'update_ratio/<layer>': |W_after - W_before| / |W_before|} (Frobenius norms over each
    layer's parameters together). A healthy run sits near 1e-3 per step; a layer far above its
    neighbours is about to go wrong. Reads the device once."""
    layers = {}
    for (name, p), w in zip(model.named_parameters(), before):
        sq = torch.stack([torch.linalg.vector_norm(p.detach() - w) ** 2, torch.linalg.vector_norm(w) ** 2])
        layers[layer_of(name)] = layers.get(layer_of(name), 0) + sq
    names = list(layers)
    sums = torch.stack([layers[n] for n in names]).tolist()  # (layers, 2) squared norms: one transfer
    return {f"update_ratio/{n}": (d / w) ** 0.5 if w > 0 else None for n, (d, w) in zip(names, sums)}


def past_decay_note(cfg, start):
    """One line when steps from `start` on run past the cosine's end (lr_decay_iters) at min_lr, as a
    run resumed with a larger max_iters does; None otherwise."""
    if not cfg.decay_lr or cfg.lr_schedule != "cosine" or cfg.max_iters <= max(start, cfg.lr_decay_iters):
        return None
    first = max(start, cfg.lr_decay_iters)
    return (
        f"note: iters {first}-{cfg.max_iters} run at min_lr={cfg.min_lr:g}, past the cosine's end at "
        f"lr_decay_iters={cfg.lr_decay_iters}; to decay over them instead, pass --lr_decay_iters={cfg.max_iters}"
    )


def schedule(optimizer, it, cfg):
    """Step `it`'s learning rate (get_lr), which train_step sets on every group, after setting Muon's
    momentum (get_momentum) on its groups: the only ones with a "momentum" (AdamW's are betas). Under
    compile Muon takes both as tensors (Muon.hyper): inputs of its graphs, so moving them never
    recompiles. The same on every rank, as the step is, so DDP and FSDP need nothing more."""
    for group in optimizer.param_groups:
        if "momentum" in group:
            group["momentum"] = get_momentum(it, cfg)
    return get_lr(it, cfg)


def get_momentum(it, cfg):
    """Muon's momentum: muon_momentum, reached by a straight line from muon_momentum_start over the
    first muon_momentum_warmup steps (modded-nanogpt's 0.85 -> 0.95 over 300), and, with
    muon_momentum_cooldown, a straight line down to that value over lr_schedule='wsd''s decay (which
    wins where the two overlap). A function of the step alone, as get_lr is, so a resumed run
    continues it exactly; with both off, this run's muon_momentum, as a resume takes this run's
    learning_rate."""
    m = cfg.muon_momentum
    if it < cfg.muon_momentum_warmup:
        m = cfg.muon_momentum_start + it / cfg.muon_momentum_warmup * (m - cfg.muon_momentum_start)
    if cfg.muon_momentum_cooldown and it >= decay_start(cfg):
        progress = min(1.0, (it - decay_start(cfg)) / max(1, cfg.max_iters - decay_start(cfg)))
        m = cfg.muon_momentum + progress * (cfg.muon_momentum_cooldown - cfg.muon_momentum)
    return m


def decay_start(cfg):
    """lr_schedule='wsd': the step its decay starts, never inside the warmup."""
    return max(cfg.warmup_iters, (1 - cfg.decay_frac) * cfg.max_iters)


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
        start = decay_start(cfg)
        if it < start:
            return cfg.learning_rate
        if it >= cfg.max_iters:
            return cfg.min_lr
        progress = (it - start) / (cfg.max_iters - start)
        return cfg.learning_rate + progress * (cfg.min_lr - cfg.learning_rate)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)
