"""The optimizer train.py steps: nanoGPT's AdamW over every parameter, or Muon for the blocks'
weight matrices with AdamW for the rest; the learning-rate schedule; and the per-layer
update-to-weight ratio for the logs.

Muon (torch.optim.Muon) replaces each matrix's momentum by the nearest semi-orthogonal
matrix (five Newton-Schulz iterations) before stepping, so every direction of the update moves
by about the same amount. It is defined for 2-D hidden-layer weights only: the embeddings,
lm_head (tied to wte), norm gains and biases stay with AdamW, as in modded-nanogpt and nanochat.

Ours is torch's update with the iterations batched: the matrices of one shape are stacked and
orthogonalized together (modded-nanogpt does the same), three batched matmuls per iteration and
shape where torch's loop runs three per matrix: 60 matmuls a step for the speedrun's 48 matrices
of 4 shapes, against 720. With compile=True the iterations are compiled. It takes train_step's
skip flag on the device (found_inf, as fused AdamW does), so a Muon step needs no host sync.

torch's Muon runs the iterations in bfloat16, the right call on a GPU's tensor cores. A CPU
without bfloat16 matmul units (no AVX512-BF16 or AMX) emulates them: on a 2-core AVX2 EPYC the
quick start's 8 small matrices took 440 ms a step in bfloat16 against 7 ms in float32. So on a CPU
Muon here orthogonalizes in float32 (CPU_NS_DTYPE), elsewhere in bfloat16 as torch does.
"""

import math

import torch


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


CPU_NS_DTYPE = torch.float32  # the Newton-Schulz iterations' dtype on a CPU (torch's own: bfloat16)


def orthogonalize(m, coefficients, steps, eps):
    """torch's Newton-Schulz iteration (torch.optim._muon) on a stack of matrices, in m's dtype:
    m (k, A, B) -> about U V^T of each matrix's SVD, each singular value pushed into roughly
    [0.5, 1.5] by a quintic polynomial. baddbmm is torch's addmm batched: the same rounding."""
    a, b, c = coefficients
    wide = m.size(-2) > m.size(-1)
    x = m.mT if wide else m  # iterate on the (short, long) side: the Gram matrices are the smaller ones
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # each: spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT  # (k, A, A)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if wide else x


def ns_dtype(device):
    """The dtype Muon orthogonalizes in on `device`: bfloat16 as torch's Muon, float32 on a CPU."""
    return CPU_NS_DTYPE if device.type == "cpu" else torch.bfloat16


class Muon(torch.optim.Muon):
    """torch.optim.Muon's update with the Newton-Schulz iterations batched over same-shape
    matrices (compiled with compile=True), in bfloat16, or float32 on a CPU. The same
    hyperparameters, state (momentum_buffer) and learning-rate scaling as torch's, so checkpoints
    move between them and between devices. Like fused AdamW it takes GradScaler's protocol
    (grad_scale, found_inf set before step): where found_inf is 1 the weights and momenta stay
    bit-unchanged, decided on the device."""

    _step_supports_amp_scaling = True

    def __init__(self, params, compile=False, **kwargs):
        super().__init__(params, **kwargs)
        # dynamic=False: one graph per shape (four for a GPT's blocks), each its own static kernels
        self.orthogonalize = torch.compile(orthogonalize, dynamic=False, fullgraph=True) if compile else orthogonalize

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)  # torch's: checks, and zero momentum on first use
            stacks = {}  # shape -> (params, grads, momenta)
            for tensors in zip(params, grads, bufs):
                for stack, t in zip(stacks.setdefault(tensors[0].shape, ([], [], [])), tensors):
                    stack.append(t)
            for stack in stacks.values():
                self._step_stack(group, *stack, grad_scale, found_inf)
        return loss

    def _step_stack(self, group, params, grads, bufs, grad_scale, found_inf):
        """torch's update, element for element, on k matrices of one shape (their updates stacked
        (k, A, B) for the iteration); foreach ops elsewhere, in place where the step cannot be
        skipped."""
        lr, momentum, decay = group["lr"], group["momentum"], 1 - group["lr"] * group["weight_decay"]
        if grad_scale is not None:  # gradients still multiplied by fp16's loss scale
            grads = torch._foreach_div(grads, grad_scale)
        if found_inf is None:
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            new_bufs = bufs
        else:
            new_bufs = torch._foreach_lerp(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, new_bufs, momentum) if group["nesterov"] else new_bufs
        dtype = ns_dtype(params[0].device)
        update = torch.stack([u.to(dtype) for u in updates])  # (k, A, B)
        update = self.orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if found_inf is not None:  # a skipped step, decided on the device: the old momenta, no decay,
            skip = found_inf.bool()  # and a zero update (alpha < 0 adds -0.0: every weight bit for bit)
            torch._foreach_copy_(bufs, [torch.where(skip, old, new) for old, new in zip(bufs, new_bufs)])
            update, decay = torch.where(skip, 0, update), torch.where(skip, 1.0, decay)
        if group["weight_decay"]:
            torch._foreach_mul_(params, decay)
        ratio = adjusted_lr_ratio(group["adjust_lr_fn"], params[0].shape)
        torch._foreach_add_(params, update.unbind(0), alpha=-lr * ratio)


def adjusted_lr_ratio(adjust_lr_fn, shape):
    """torch's Muon learning-rate scale for an (A, B) matrix: 'original' (the default) sqrt(max(1, A/B)),
    'match_rms_adamw' 0.2 sqrt(max(A, B)), so the update's RMS matches AdamW's."""
    A, B = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    return 1.0


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
    muon = Muon(
        [{"params": matrices, "lr_scale": cfg.muon_lr / cfg.learning_rate}],
        compile=cfg.compile,
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
