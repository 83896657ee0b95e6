"""train_step without host-device synchronization: nothing is read from the device during a step, a
non-finite step is skipped on the device with the weights and optimizer state bit-unchanged, and
max_bad_steps still stops the run (exit 3)."""

from contextlib import nullcontext

import numpy as np
import pytest
import torch
from conftest import CPU, TINY, read_metrics, tiny_args
from processes import run_script
from train_rank import nan_loss, nan_steps

from gpt.data.batches import TrainBatches
from gpt.outdir import checkpoint
from gpt.train.step import train_step
from model import GPT, GPTConfig

MODEL = dict(TINY, bias=True)
# every way Python code reads a tensor's value into the host: on a GPU each waits for the queue to drain
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@pytest.fixture
def reads(monkeypatch):
    """The names of the tensors' host reads while the fixture is active."""
    seen = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            seen.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


def setup_step(optimizer_kind="fused"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    if optimizer_kind == "fused":
        optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")  # what training_setup.build makes
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)  # no found_inf support
    data = np.random.default_rng(0).integers(0, 65, size=2000).astype(np.uint16)
    batches = TrainBatches(data, 4, 16, 0, CPU)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return model, optimizer, scaler, batches


def step(model, optimizer, scaler, batches, poison=False):
    with nan_loss(model) if poison else nullcontext():
        return train_step(model, optimizer, scaler, batches, 1e-3, 2, 1.0, CPU)


def test_a_step_reads_nothing_from_the_device(reads):
    model, optimizer, scaler, batches = setup_step()
    step(model, optimizer, scaler, batches)  # the first step also creates AdamW's state
    reads.clear()
    result = step(model, optimizer, scaler, batches)
    poisoned = step(model, optimizer, scaler, batches, poison=True)
    assert reads == []
    assert bool(result.stepped) and not bool(poisoned.stepped)  # the results are there, read afterwards
    assert reads == ["__bool__", "__bool__"]  # and the instrument sees reads


def test_an_optimizer_without_found_inf_falls_back_to_one_read(reads):
    model, optimizer, scaler, batches = setup_step("plain")
    step(model, optimizer, scaler, batches)
    reads.clear()
    step(model, optimizer, scaler, batches)
    # the documented fallback: one read decides the step (the unfused optimizer reads its step counts too)
    assert reads.count("__bool__") == 1


def test_a_poisoned_step_leaves_weights_and_optimizer_state_bit_unchanged():
    model, optimizer, scaler, batches = setup_step()
    for _ in range(2):
        step(model, optimizer, scaler, batches)
    snapshot = lambda: (
        {k: v.clone() for k, v in model.state_dict().items()},
        [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()],
    )
    weights, state = snapshot()
    result = step(model, optimizer, scaler, batches, poison=True)
    assert not bool(result.stepped) and not torch.isfinite(result.loss)
    after_weights, after_state = snapshot()
    assert all(torch.equal(weights[k], after_weights[k]) for k in weights)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(state, after_state) for k in a)  # exp_avg, exp_avg_sq, step
    assert bool(step(model, optimizer, scaler, batches).stepped)  # and the next good step moves them again
    assert not all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_bad_steps_between_logs_stop_the_run_at_the_next_log(char_data, tmp_path, monkeypatch):
    """Steps 6-8 non-finite, max_bad_steps=3, a log every 5: the run stops at the log at step 10, with
    the eval's checkpoint at 8."""
    out = tmp_path / "out"
    nan_steps(monkeypatch.setattr, {6, 7, 8})
    args = tiny_args(char_data, out, max_iters=50, eval_interval=4, max_bad_steps=3, log_interval=5)
    result = run_script("train.py", *args, "--always_save_checkpoint=True")
    assert result.returncode == 3, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "3 steps in a row" in result.stderr
    assert (
        "iter 10: non-finite loss or gradient norm, 1 step(s) skipped since the last log (0 in a row)" in result.stdout
    )
    assert max(r["iter"] for r in read_metrics(out) if "loss" in r) == 5  # stopped at the log of step 10
    state = checkpoint.load(str(out / "ckpt.pt"))
    assert state["iter_num"] == 8 and all(torch.isfinite(v).all() for v in state["model"].values())
