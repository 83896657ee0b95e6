"""The optimizer train.py steps: nanoGPT's AdamW over every parameter, or Muon for the blocks'
weight matrices with AdamW for the rest; the learning-rate schedule; and the per-layer
update-to-weight ratio for the logs.

Muon (torch.optim.Muon) replaces each matrix's momentum by the nearest semi-orthogonal
matrix (five Newton-Schulz iterations) before stepping, so every direction of the update moves
by about the same amount. It is defined for 2-D hidden-layer weights only: the embeddings,
lm_head (tied to wte), norm gains and biases stay with AdamW, as in modded-nanogpt and nanochat.

torch's Muon runs those iterations in bfloat16, the right call on a GPU's tensor cores. A CPU
without bfloat16 matmul units (no AVX512-BF16 or AMX) emulates them: on a 2-core AVX2 EPYC the
quick start's 8 small matrices took 440 ms a step in bfloat16 against 7 ms in float32. So on a CPU
Muon here orthogonalizes in float32 (CPU_NS_DTYPE), and elsewhere it is torch's step unchanged.
"""

import math

import torch


class Optimizers:
    """Several torch optimizers stepped as one. param_groups lists every group of every
    optimizer, so train_step's schedule sets all their learning rates (a group's `lr_scale`
    keeps its own peak as a ratio to learning_rate); the state_dict holds each one's state in
    order, for exact resume."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self):  # read afresh: load_state_dict replaces each optimizer's group dicts
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()

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


def orthogonalize(m, coefficients, steps, eps, dtype):
    """torch's Newton-Schulz iteration (torch.optim._muon) in `dtype`: m (A, B) -> about U V^T of
    its SVD, each singular value pushed into roughly [0.5, 1.5] by a quintic polynomial."""
    a, b, c = coefficients
    x = m.to(dtype)
    wide = x.size(0) > x.size(1)
    if wide:
        x = x.T  # iterate on the (short, long) side: the Gram matrix is the smaller one
    x = x.div(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon, whose step on CPU parameters orthogonalizes in CPU_NS_DTYPE; the same
    hyperparameters, state (momentum_buffer) and learning-rate scaling, so checkpoints move
    between devices. On any other device it is torch's step."""

    @torch.no_grad()
    def step(self, closure=None):
        if any(p.device.type != "cpu" for group in self.param_groups for p in group["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)  # torch's: checks, and zero momentum on first use
            for p, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], CPU_NS_DTYPE)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * adjusted_lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss


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
