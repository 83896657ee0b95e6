"""The `attention` key: each SDPA kernel gives the same loss and gradients, the chosen kernel is the
one that runs, and an unknown or unavailable kernel is a one-line error."""

import pytest
import torch
from conftest import TINY, one_line_error, tiny_args
from processes import run_script

from gpt.train.build import attention_error
from model import GPT, GPTConfig

MODEL = dict(TINY, n_head=4, n_kv_head=2)


def loss_and_grads(attention):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    model.set_attention(attention)
    x = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    _, loss = model(x, x)
    loss.backward()
    return loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("attention", ["flash", "math"])  # the kernels a CPU has
def test_kernels_agree_with_auto(attention):
    loss, grads = loss_and_grads("auto")
    other_loss, other_grads = loss_and_grads(attention)
    torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(other_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def sdpa_ops(attention):
    model = GPT(GPTConfig(**MODEL))
    model.set_attention(attention)
    x = torch.zeros(1, 16, dtype=torch.long)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x, x)
    return {e.key for e in prof.key_averages() if "attention" in e.key or "softmax" in e.key}


def test_the_chosen_kernel_is_the_one_that_runs():
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in sdpa_ops("flash")
    math = sdpa_ops("math")
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in math and "aten::_softmax" in math


def test_probe_says_which_kernels_a_cpu_lacks():
    model = GPT(GPTConfig(**MODEL))
    assert attention_error(model.config, "flash", "cpu", torch.float32) is None
    assert attention_error(model.config, "cudnn", "cpu", torch.float32)  # a reason, not None


# What CUDA's torch warns when a kernel declines, as users have pasted it (pytorch's warnings quoted
# in Dao-AILab/flash-attention issue #1321): a header, then the reason, then it raises.
CUDA_DECLINES = {
    "efficient": [
        "Memory efficient kernel not used because: (Triggered internally at ../aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:718.)",
        "Memory Efficient attention has been runtime disabled. (Triggered internally at ../aten/src/ATen/native/transformers/sdp_utils_cpp.h:495.)",
    ],
    "cudnn": [
        "CuDNN attention kernel not used because: (Triggered internally at ../aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:722.)",
        "The CuDNN backend needs to be enabled by setting the enviornment variable`TORCH_CUDNN_SDPA_ENABLED=1` (Triggered internally at ../aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:496.)",
    ],
}


@pytest.mark.parametrize("attention", sorted(CUDA_DECLINES))
def test_an_unavailable_kernel_is_explained_by_its_reason_not_the_header(monkeypatch, attention):
    import warnings

    def declining_sdpa(*args, **kwargs):
        for message in CUDA_DECLINES[attention]:
            warnings.warn(message, UserWarning)
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", declining_sdpa)
    reason = attention_error(GPTConfig(**MODEL), attention, "cpu", torch.float32)
    assert reason == CUDA_DECLINES[attention][1].split(" (Triggered")[0]  # the reason, without where torch raised it


@pytest.mark.parametrize(
    "value, message", [("fast", "attention='fast' is not one of"), ("cudnn", "attention='cudnn' cannot run on cpu")]
)
def test_bad_attention_values_are_one_line(char_data, tmp_path, value, message):
    one_line_error(run_script("train.py", *tiny_args(char_data, tmp_path / "out", attention=value)), message)
