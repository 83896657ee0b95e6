"""The CUDA paths, checked on a CPU: runtime.setup against a simulated machine with two GPUs
(torch.cuda patched, set_device held to torch's own rule for a device index), with and without
torchrun. No GPU runs here; tests/test_gpu.py is for that."""

import pytest
import torch

import runtime
from configurator import UserError

TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as a machine with two bf16-capable GPUs shows it. set_device applies the rule
    torch.cuda.set_device applies first (torch.cuda._get_device_index: an index, or a device
    string that has one; 'cuda' alone raises ValueError), fails past the second GPU as CUDA
    would, and records the index. The TF32 flags are restored afterwards. Yields what set_device
    and init_process_group were called with."""
    calls = {"set_device": [], "init_process_group": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)

    def set_device(device):
        index = torch.cuda._get_device_index(device)
        if index >= 2:
            raise RuntimeError("CUDA error: invalid device ordinal")
        calls["set_device"].append(index)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: calls["init_process_group"].append(kwargs))
    for key in TORCHRUN_KEYS:
        monkeypatch.delenv(key, raising=False)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield calls
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.parametrize("device, expected", [("auto", "cuda:0"), ("cuda", "cuda:0"), ("cuda:1", "cuda:1")])
def test_single_process_gets_an_indexed_device(two_gpus, device, expected):
    rt = runtime.setup(device, "auto")
    assert (rt.device, rt.device_type, rt.dtype, rt.world_size) == (expected, "cuda", torch.bfloat16, 1)
    assert two_gpus["set_device"] == [int(expected[-1])]
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert two_gpus["init_process_group"] == []
    # bench.py and others hand rt.device to child processes as --device: it must set up the same
    assert runtime.setup(rt.device).device == rt.device


@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:0"])
def test_torchrun_rank_takes_the_gpu_of_its_local_rank(two_gpus, monkeypatch, device):
    for key, value in (("RANK", "3"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    rt = runtime.setup(device, "auto")
    assert (rt.device, rt.rank, rt.local_rank, rt.world_size, rt.master) == ("cuda:1", 3, 1, 4, False)
    assert two_gpus["set_device"] == [1]
    assert two_gpus["init_process_group"] == [{"backend": "nccl"}]


def test_more_ranks_than_gpus_is_one_line(two_gpus, monkeypatch):
    for key, value in (("RANK", "2"), ("LOCAL_RANK", "2"), ("WORLD_SIZE", "3")):
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=r"LOCAL_RANK=2 but only 2 CUDA device\(s\)") as e:
        runtime.setup("auto")
    assert "\n" not in str(e.value)


def test_a_device_past_the_last_gpu_is_one_line(two_gpus):
    with pytest.raises(UserError, match=r"device='cuda:2' but only 2 CUDA device\(s\) exist"):
        runtime.setup("cuda:2")


def test_peak_flops_are_looked_up_for_the_indexed_device(two_gpus, monkeypatch):
    names = {0: "NVIDIA A100-SXM4-80GB", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names[torch.cuda._get_device_index(device)])
    rt = runtime.setup("cuda:1", "bfloat16")
    assert runtime.device_peak_flops(rt) == 989.4e12
