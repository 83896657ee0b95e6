"""The Apple GPU paths (device=mps, device=auto's pick on a Mac) checked on a CPU, as
test_cuda_contract.py checks CUDA's: torch.backends.mps says MPS is there, torch.cuda says no GPU,
torch.mps's calls are recorded. The decisions are checked (autocast, GradScaler, optimizer, pinned
memory, compile, synchronization, the RNG in checkpoints, torchrun and old macOS refused); no MPS
kernel runs."""

import numpy as np
import pytest
import torch

from configurator import TrainConfig, UserError
from gpt.data import batches
from gpt.device import runtime
from gpt.outdir import checkpoint
from gpt.train import build
from model import GPT, GPTConfig

TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# torch.mps.get_rng_state() of a Mac: a uint8 tensor (the Philox state and the seed); its content is opaque here
MPS_RNG = torch.arange(44, dtype=torch.uint8)
SHAPE = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, dropout=0.0)


@pytest.fixture
def mps(monkeypatch):
    """A Mac on macOS 15: MPS available, no CUDA. torch.mps's calls are recorded, and answer as
    an MPS device would; torch.distributed's init_process_group is recorded, never run."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: (15, 0) >= (major, minor))
    for name in ("synchronize", "empty_cache", "manual_seed", "set_rng_state"):
        monkeypatch.setattr(torch.mps, name, lambda *args, _name=name, **kwargs: calls.append((_name, *args)))
    get_rng_state = lambda device="mps": calls.append(("get_rng_state",)) or MPS_RNG.clone()
    monkeypatch.setattr(torch.mps, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: calls.append(("cuda.synchronize",)))
    init_process_group = lambda **kwargs: calls.append(("init_process_group", kwargs))
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    for key in TORCHRUN_KEYS:
        monkeypatch.delenv(key, raising=False)
    return calls


@pytest.mark.parametrize("device", ["auto", "mps"])
def test_auto_and_mps_train_in_float32_without_autocast(mps, device):
    rt = runtime.setup(device, "auto")
    assert (rt.device, rt.device_type, rt.dtype, rt.world_size) == ("mps", "mps", torch.float32, 1)
    assert not isinstance(rt.autocast(), torch.autocast)
    assert mps == []  # no process group, nothing asked of the device yet


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_autocasts_on_the_mps_device(mps, dtype):
    ctx = runtime.setup("mps", dtype).autocast()
    assert isinstance(ctx, torch.autocast)
    assert (ctx.device, ctx.fast_dtype, ctx._enabled) == ("mps", getattr(torch, dtype), True)


def test_bfloat16_before_macos_14_is_one_line(mps, monkeypatch):
    # MPS runs bfloat16 only from macOS 14 (Sonoma)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: (13, 5) >= (major, minor))
    with pytest.raises(UserError) as e:
        runtime.setup("mps", "bfloat16")
    assert str(e.value) == "dtype='bfloat16' on MPS needs macOS 14 or newer; use --dtype=float16 or --dtype=float32"
    assert runtime.setup("mps", "float16").dtype == torch.float16


def test_torchrun_on_mps_is_one_line(mps, monkeypatch):
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=r"^torchrun with device=mps: torch.distributed has no MPS backend"):
        runtime.setup("auto")
    assert mps == []  # refused before joining a process group that would then hang or fail on MPS tensors


def tiny_build(rt, **overrides):
    """training_setup.build as train.py calls it on `rt`, for a tiny model left on the CPU."""
    cfg = TrainConfig(**SHAPE, **overrides)
    return build.build(GPT(GPTConfig(**SHAPE, vocab_size=64)), cfg, rt)


@pytest.mark.parametrize("dtype, scaled", [("float32", False), ("bfloat16", False), ("float16", True)])
def test_the_grad_scaler_is_torch_amps_for_mps_and_only_for_float16_and_adamw_is_not_fused(mps, dtype, scaled):
    _, _, optimizer, scaler = tiny_build(runtime.setup("mps", dtype), compile=False)
    # torch.amp's scaler on device 'mps' (nanoGPT made torch.cuda.amp's, which turns itself off without CUDA)
    assert scaler._device == "mps" and scaler.is_enabled() == scaled
    # MPS's fused AdamW kernel ignored found_inf (pytorch#186360): step.py hands a non-finite
    # step to it as found_inf=1, and the weights would have taken the NaN update anyway
    assert not optimizer.defaults["fused"] and not getattr(optimizer, "_step_supports_amp_scaling", False)


def test_compile_is_on_by_default_on_mps(mps):
    # the default is the same on every device; --compile=False turns it off
    assert TrainConfig().compile
    model, train_model, _, _ = tiny_build(runtime.setup("mps", "float32"))
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and train_model is model
    model, _, _, _ = tiny_build(runtime.setup("mps", "float32"), compile=False)
    assert isinstance(model, GPT)


def test_batches_go_to_mps_unpinned(mps, monkeypatch):
    moved = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: pytest.fail("pinned memory is a CUDA feature"))
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: moved.append((args, kwargs)) or self)
    data = np.arange(100, dtype=np.uint16)
    x, y = batches.get_batch(data, np.array([0, 50]), 8, runtime.setup("mps", "float32"))
    assert moved == [(("mps",), {})]  # one copy, blocking: MPS has no pinned-memory path to overlap
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_synchronize_waits_for_the_mps_queue(mps):
    runtime.synchronize(runtime.setup("mps", "float32"))
    assert mps == [("synchronize",)]


def test_a_checkpoint_carries_the_mps_rng_and_restores_it_on_mps(mps, capsys):
    rt = runtime.setup("mps", "float32")
    rng = checkpoint.gather_rng(rt)
    assert set(rng) == {"torch", "mps"} and torch.equal(rng["mps"][0], MPS_RNG)
    state = {"rng": {**rng, "batches": np.random.default_rng(3).bit_generator.state}}
    cpu_rng = torch.get_rng_state()
    mps.clear()
    checkpoint.restore_rng(state, batches.TrainBatches(np.zeros(32, np.uint16), 1, 8, 0, rt), rt)
    assert len(mps) == 1 and mps[0][0] == "set_rng_state" and torch.equal(mps[0][1], MPS_RNG)
    # the same checkpoint on a CPU: the MPS state has no generator to go to, and that is said
    checkpoint.restore_rng(
        state, batches.TrainBatches(np.zeros(32, np.uint16), 1, 8, 0, rt), runtime.setup("cpu", "float32")
    )
    note = "note: checkpoint was written on mps, this run is on cpu: its mps RNG state is unused"
    assert note in capsys.readouterr().out
    torch.set_rng_state(cpu_rng)


def test_a_sharded_checkpoint_writes_the_mps_rng(mps):
    rt = runtime.setup("mps", "float32")
    raw = GPT(GPTConfig(**SHAPE, vocab_size=64))
    tensors, _ = checkpoint.sharded_state(raw, torch.optim.AdamW(raw.parameters()), rt)
    assert set(tensors["rng"]) == {"torch_0", "mps_0"} and torch.equal(tensors["rng"]["mps_0"], MPS_RNG)
