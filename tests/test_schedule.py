"""The learning-rate schedule, and gradient accumulation being the same step as one big batch."""

import copy
import math
import re

import numpy as np
import pytest
import torch
from conftest import CPU, TINY, losses, train_tiny_run

from configurator import TrainConfig, UserError
from gpt.outdir import checkpoint
from gpt.train import optim
from gpt.train.optim import get_lr, get_momentum
from gpt.train.step import train_step
from model import GPT, GPTConfig

# ---------------------------------------------------------------------------- get_lr


def schedule_cfg(**overrides):
    args = dict(learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=110, max_iters=150)
    return TrainConfig(**{**args, **overrides})


def test_warmup_is_linear_from_above_zero_to_learning_rate():
    cfg = schedule_cfg()
    warm = [get_lr(it, cfg) for it in range(cfg.warmup_iters + 1)]
    assert warm[0] > 0  # the first step moves the weights
    assert warm[-1] == pytest.approx(cfg.learning_rate)  # reached at the end of warmup
    steps = np.diff(warm)
    np.testing.assert_allclose(steps, steps[0], rtol=1e-9)  # equal increments
    assert steps[0] > 0


def test_cosine_decay():
    cfg = schedule_cfg()
    mid = (cfg.warmup_iters + cfg.lr_decay_iters) // 2
    assert get_lr(mid, cfg) == pytest.approx((cfg.learning_rate + cfg.min_lr) / 2)
    quarter = cfg.warmup_iters + (cfg.lr_decay_iters - cfg.warmup_iters) // 4
    expected = cfg.min_lr + (cfg.learning_rate - cfg.min_lr) * (1 + math.cos(math.pi / 4)) / 2
    assert get_lr(quarter, cfg) == pytest.approx(expected)
    for it in (cfg.lr_decay_iters, cfg.lr_decay_iters + 1, cfg.max_iters, 10**6):
        assert get_lr(it, cfg) == pytest.approx(cfg.min_lr)
    after = [get_lr(it, cfg) for it in range(cfg.warmup_iters, cfg.max_iters)]
    assert all(b <= a for a, b in zip(after, after[1:]))
    assert all(cfg.min_lr <= lr <= cfg.learning_rate for lr in after)


def test_no_warmup_and_no_decay():
    cfg = schedule_cfg(warmup_iters=0)
    assert get_lr(0, cfg) == pytest.approx(cfg.learning_rate)
    assert get_lr(cfg.lr_decay_iters, cfg) == pytest.approx(cfg.min_lr)
    cfg = schedule_cfg(decay_lr=False)
    assert {get_lr(it, cfg) for it in (0, 5, 10, 60, 110, 10**6)} == {cfg.learning_rate}


# ---------------------------------------------------------------------------- gradient accumulation


MODEL = dict(TINY, bias=True)


def make_optimizer(model, kind):
    # SGD's update is the gradient itself, so it checks the gradient's scale (a missing
    # /accum_steps) which Adam's first, nearly sign-like step would hide; AdamW is the real one.
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1.0)
    return model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")


def one_step(model, optimizer, rows, accum_steps, grad_clip, lr):
    x, y = rows
    micro = len(x) // accum_steps
    calls = []

    def next_batch():
        i = len(calls)
        calls.append(i)
        return x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss = train_step(model, optimizer, scaler, next_batch, lr, accum_steps, grad_clip, CPU).loss
    assert len(calls) == accum_steps
    return loss


def total_grad_norm(model, rows):
    model.zero_grad()
    model(*rows)[1].backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    return norm.item()


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("grad_clip", [0.0, 1.0, 0.25])
def test_accumulation_equals_one_big_batch(kind, grad_clip):
    k, b, T = 4, 2, 16
    lr = 1e-3 if kind == "adamw" else 1.0
    g = torch.Generator().manual_seed(1)
    warm_rows, rows = [
        (torch.randint(0, 65, (k * b, T), generator=g), torch.randint(0, 65, (k * b, T), generator=g)) for _ in range(2)
    ]
    torch.manual_seed(0)
    big = GPT(GPTConfig(**MODEL))
    opt_big = make_optimizer(big, kind)
    one_step(big, opt_big, warm_rows, 1, grad_clip, lr=1e-3)  # so AdamW has moments to carry over
    small = copy.deepcopy(big)
    opt_small = make_optimizer(small, kind)
    opt_small.load_state_dict(copy.deepcopy(opt_big.state_dict()))  # load_state_dict shares tensors
    if grad_clip:
        # the clip must bind on the whole batch's gradient, so a per-micro-batch clip would differ
        assert total_grad_norm(big, rows) > grad_clip
    before = copy.deepcopy(big.state_dict())

    loss_big = one_step(big, opt_big, rows, 1, grad_clip, lr)
    loss_small = one_step(small, opt_small, rows, k, grad_clip, lr)

    torch.testing.assert_close(loss_small, loss_big, atol=1e-6, rtol=1e-6)  # the mean loss over the batch
    moved = 0.0
    for (name, p_big), p_small in zip(big.named_parameters(), small.parameters()):
        torch.testing.assert_close(p_small, p_big, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
        moved = max(moved, (p_big - before[name]).abs().max().item())
    assert moved > lr / 100  # the step did something to compare
    if kind == "sgd" and grad_clip:  # SGD's step is the clipped gradient itself
        step = torch.cat([(p - before[name]).flatten() for name, p in big.named_parameters()])
        assert torch.linalg.vector_norm(step).item() == pytest.approx(grad_clip, rel=1e-4)
    for state_big, state_small in zip(opt_big.state.values(), opt_small.state.values()):
        for key in state_big:
            torch.testing.assert_close(state_small[key], state_big[key], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------- Muon's momentum schedule

MOMENTUM = dict(optimizer="muon", muon_momentum_warmup=4, muon_momentum_start=0.85, muon_momentum=0.95)


def test_momentum_warms_up_then_cools_down_over_the_wsd_decay_and_bad_keys_are_one_line():
    wsd = dict(lr_schedule="wsd", warmup_iters=2, max_iters=20, decay_frac=0.5)
    cfg = TrainConfig(**MOMENTUM, **wsd, muon_momentum_cooldown=0.9)
    m = [get_momentum(it, cfg) for it in range(30)]
    assert m[:11] == pytest.approx([0.85, 0.875, 0.9, 0.925] + [0.95] * 7)  # the decay starts at 10
    assert m[10:] == pytest.approx([0.95 - 0.005 * i for i in range(10)] + [0.9] * 10)
    assert {get_momentum(it, TrainConfig(optimizer="muon")) for it in (0, 5, 10**6)} == {0.95}  # off: muon_momentum
    for bad, expected in [
        (dict(optimizer="adamw", muon_momentum_warmup=3), "muon_momentum_warmup=3 is a lever of Muon"),
        (dict(muon_momentum_warmup=-1), "muon_momentum_warmup=-1 must be >= 0"),
        (dict(muon_momentum_start=1.0), "muon_momentum_start and muon_momentum_cooldown in [0, 1)"),
        (dict(muon_momentum_cooldown=0.9), "set --lr_schedule=wsd"),
    ]:
        with pytest.raises(UserError, match=re.escape(expected)):
            TrainConfig(**{**MOMENTUM, **bad})


def test_a_moving_momentum_is_an_input_of_muons_compiled_step_never_a_recompile(aten_compile):
    cfg = TrainConfig(**MOMENTUM, compile=True, learning_rate=1e-2)
    model = GPT(GPTConfig(**TINY))
    optimizer = optim.configure(model, cfg, "cpu")
    rows = torch.randint(0, 65, (2, 2, 16), generator=torch.Generator().manual_seed(0)).unbind(0)
    one_step(model, optimizer, rows, 1, 1.0, optim.schedule(optimizer, 0, cfg))  # the compiles
    with torch.compiler.set_stance("fail_on_recompile"):
        for it in (1, 2):
            one_step(model, optimizer, rows, 1, 1.0, optim.schedule(optimizer, it, cfg))
    assert aten_compile["stats"]["unique_graphs"] == 4  # one per matrix shape (c_attn, c_proj, c_fc, mlp.c_proj)
    assert optimizer.optimizers[0].param_groups[0]["momentum"] == get_momentum(2, cfg) == pytest.approx(0.9)


def test_a_resume_inside_the_momentum_warmup_is_exact(tmp_path):
    keys = dict(MOMENTUM, muon_momentum_warmup=6, max_iters=8, lr_decay_iters=8, eval_interval=4)
    straight, half = train_tiny_run(tmp_path, **keys), train_tiny_run(tmp_path / "half", **{**keys, "max_iters": 4})
    state = checkpoint.load(str(half / "ckpt.pt"))
    assert state["optimizer"]["optimizers"][0]["param_groups"][0]["momentum"] == pytest.approx(0.85 + 0.1 * 3 / 6)
    train_tiny_run(tmp_path / "half", **keys, init_from="resume")
    assert losses(half) == losses(straight) and len(losses(straight)) == 8 + 2 * 3
