"""What only a CUDA GPU can show: a bf16 step, fused AdamW's and compiled Muon's skip of a poisoned
step with no host sync, each `attention` value's SDPA kernel and loss, pinned batches, RMSNorm's fused
kernel, FP8's matmuls against their emulation. Skipped without CUDA (FP8's test without FP8 units)."""

import numpy as np
import pytest
import torch
from processes import load_script
from torch.utils._python_dispatch import TorchDispatchMode
from train_rank import nan_loss

from configurator import TrainConfig
from gpt.data.batches import TrainBatches, get_batch
from gpt.device import runtime
from gpt.train import fp8, muon, optim
from gpt.train.build import attention_error
from gpt.train.step import train_step
from model import GPT, GPTConfig, RMSNorm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

battery = load_script("scripts/gpu_battery.py")  # sdpa_kernel_kind: which kernel a profiler event belongs to

MODEL = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, block_size=64, vocab_size=65, dropout=0.0, bias=False)


@pytest.fixture
def rt():
    return runtime.setup("cuda", "bfloat16")


def setup_step(rt, attention="auto"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL)).to(rt.device)
    model.set_attention(attention)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda")
    data = np.random.default_rng(0).integers(0, 65, size=20_000).astype(np.uint16)
    batches = TrainBatches(data, 8, 64, 0, rt)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    return model, optimizer, scaler, batches


def test_bf16_step_trains_with_fused_adamw(rt):
    model, optimizer, scaler, batches = setup_step(rt)
    assert optimizer.defaults["fused"] and optimizer._step_supports_amp_scaling
    before = [p.detach().clone() for p in model.parameters()]
    losses = [train_step(model, optimizer, scaler, batches, 1e-3, 2, 1.0, rt).loss for _ in range(5)]
    assert all(torch.isfinite(torch.stack(losses)))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast computes in bf16, weights stay fp32
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_step_never_waits_for_the_gpu_and_a_poisoned_one_changes_nothing(rt):
    model, optimizer, scaler, batches = setup_step(rt)
    train_step(model, optimizer, scaler, batches, 1e-3, 2, 1.0, rt)  # AdamW's state exists from here
    torch.cuda.synchronize()
    weights = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        with nan_loss(model):
            result = train_step(model, optimizer, scaler, batches, 1e-3, 2, 1.0, rt)
        good = train_step(model, optimizer, scaler, batches, 1e-3, 2, 1.0, rt)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not bool(result.stepped) and bool(good.stepped)
    # replay without the good step: the poisoned one alone leaves everything bit-unchanged
    model2, optimizer2, scaler2, batches2 = setup_step(rt)
    train_step(model2, optimizer2, scaler2, batches2, 1e-3, 2, 1.0, rt)
    with nan_loss(model2):
        train_step(model2, optimizer2, scaler2, batches2, 1e-3, 2, 1.0, rt)
    assert all(torch.equal(a, b) for a, b in zip(weights, model2.parameters()))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(state, optimizer2.state.values()) for k in a)


def test_batches_are_pinned_copies_on_the_gpu(rt):
    data = np.arange(10_000, dtype=np.uint16) % 65
    offsets = np.array([0, 100, 2000])
    x, y = get_batch(data, offsets, 64, rt)
    assert x.is_cuda and y.is_cuda
    expected = torch.from_numpy(data[offsets[:, None] + np.arange(65)].astype(np.int64))
    assert torch.equal(x.cpu(), expected[:, :-1]) and torch.equal(y.cpu(), expected[:, 1:])


@pytest.mark.parametrize("attention", ["flash", "efficient", "cudnn"])
def test_each_attention_value_runs_its_kernel_with_the_same_loss(rt, attention):
    probe = GPT(GPTConfig(**MODEL)).to(rt.device)
    reason = attention_error(probe.config, attention, rt.device, rt.dtype)
    if reason:  # e.g. the memory-efficient kernel and grouped-query attention, in torch 2.11
        pytest.skip(f"{attention} is not available on this GPU: {reason}")
    losses = {}
    for name in ("math", attention):
        model, optimizer, scaler, batches = setup_step(rt, name)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            losses[name] = train_step(model, optimizer, scaler, batches, 1e-3, 1, 1.0, rt).loss.item()
            torch.cuda.synchronize()
        kinds = {battery.sdpa_kernel_kind(e.key) for e in prof.key_averages()} - {None}
    assert kinds == {attention}, sorted(e.key for e in prof.key_averages())  # cuDNN's kernels say "flash" too
    assert losses[attention] == pytest.approx(losses["math"], abs=2e-2)  # bf16 rounding differs per kernel


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < fp8.FP8_CAPABILITY,
    reason="needs a GPU with FP8 units (compute capability 8.9+)",
)
def test_fp8_matmuls_match_their_emulation_and_compiled_steps_track_bf16(rt):
    """A converted layer on the FP8 units (torch._scaled_mm) against torchao's emulation of the same
    casts; then 10 compiled steps with fp8=True against the same steps in bf16."""
    torch.manual_seed(0)
    real, emulated = GPT(GPTConfig(**MODEL)).to(rt.device), GPT(GPTConfig(**MODEL)).to(rt.device)
    emulated.load_state_dict(real.state_dict())
    fp8.convert(real, True, "lm_head", rt.device)
    fp8.convert(emulated, "emulate", "lm_head", rt.device)
    x = torch.randn(8, 64, 128, device=rt.device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = (m.transformer.h[0].mlp.c_fc(x).float() for m in (real, emulated))
    # the same float8 operands and scales; only the accumulation (fast, on the FP8 units) and bf16's
    # rounding of the output differ. A wrong scale would be off by a power of two
    assert (a - b).abs().max() <= 2e-2 * b.abs().max()

    losses = {}
    for mode in (False, True):
        model, optimizer, scaler, batches = setup_step(rt)
        fp8.convert(model, mode, "lm_head", rt.device)  # the optimizer's parameters are still the model's
        compiled = torch.compile(model, dynamic=False)
        losses[mode] = torch.stack(
            [train_step(compiled, optimizer, scaler, batches, 1e-3, 2, 1.0, rt).loss for _ in range(10)]
        )
    assert torch.isfinite(losses[True]).all()
    assert (losses[True] - losses[False]).abs().max() < 2e-2, (losses[False].tolist(), losses[True].tolist())


def test_rmsnorm_under_bf16_autocast_runs_the_fused_kernel(rt):
    """model.RMSNorm hands rms_norm one dtype (tests/test_levers.py), so CUDA dispatches its fused
    kernel: the op itself, not the float32 chain of ops torch falls back to."""
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    norm = RMSNorm(128).to(rt.device)
    x = torch.randn(8, 64, 128, device=rt.device, dtype=torch.bfloat16, requires_grad=True)
    with Ops(), rt.autocast():
        norm(x).sum().backward()
    assert any("_fused_rms_norm" in op for op in ops), ops


def test_muon_beside_adamw_steps_without_a_sync_and_a_poisoned_step_changes_nothing(rt):
    cfg = TrainConfig(optimizer="muon", learning_rate=1e-3, muon_lr=0.02, compile=True)
    model, _, scaler, batches = setup_step(rt)
    optimizer = optim.configure(model, cfg, "cuda")  # Muon's iteration compiled, as train.py builds it
    train_step(model, optimizer, scaler, batches, 1e-3, 2, 1.0, rt)  # compiles, and the states exist
    torch.cuda.synchronize()
    weights = [p.detach().clone() for p in model.parameters()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with nan_loss(model):
            poisoned = train_step(model, optimizer, scaler, batches, 1e-3, 2, 1.0, rt)
        after = [p.detach().clone() for p in model.parameters()]
        good = train_step(model, optimizer, scaler, batches, 1e-3, 2, 1.0, rt)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not bool(poisoned.stepped) and bool(good.stepped)
    assert all(torch.equal(a, b) for a, b in zip(weights, after))
    assert not all(torch.equal(a, b) for a, b in zip(after, model.parameters()))


def test_batched_compiled_muon_steps_each_matrix_as_torch_muon(rt):
    torch.manual_seed(0)
    shapes = [(384, 128), (128, 128), (512, 128), (128, 512)] * 3
    ours = [torch.nn.Parameter(torch.randn(s, device=rt.device)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = muon.Muon(ours, compile=True, lr=0.02, momentum=0.95, weight_decay=0.1)
    ref = torch.optim.Muon(theirs, lr=0.02, momentum=0.95, weight_decay=0.1)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):  # both iterate in bfloat16; inductor rounds its fused ops its own way
        ratio = muon.adjusted_lr_ratio(None, p.shape)
        assert (p - q).abs().max() < 3 * 2 * 0.02 * ratio * 2**-7, p.shape
