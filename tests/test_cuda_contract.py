"""The CUDA paths, checked on a CPU: runtime.setup against a simulated machine with two GPUs
(torch.cuda patched, set_device held to torch's own rule for a device index), with and without
torchrun. No GPU runs here; tests/test_gpu.py is for that."""

import dataclasses
import datetime
import shutil
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from processes import REPO, run, run_python
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from configurator import TrainConfig, UserError
from gpt.data.batches import ChatBatches, ChatData, TrainBatches, chat_eval_offsets, eval_offsets, get_batch
from gpt.device import cpu_matmuls, gpu_flops, runtime
from gpt.inference import sampling
from gpt.train import build, stopping
from gpt.train.auto_batch import auto_batch_size
from gpt.train.step import evaluate, train_step
from model import GPT, GPTConfig

TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as a machine with two bf16-capable GPUs shows it; set_device takes what torch's does
    ('cuda' alone raises ValueError), fails past the second GPU, and records the index. Yields what
    set_device and init_process_group were called with."""
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
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls["init_process_group"].append(kw))
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
    # every collective bounded: a rank whose peer died fails after dist_timeout_s, and torchrun can restart it
    assert two_gpus["init_process_group"] == [{"backend": "nccl", "timeout": datetime.timedelta(seconds=600)}]


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
    assert gpu_flops.device_peak_flops(rt) == 989.4e12


# ---------------------------------------------------------------------------- a step, an eval and generation on a fake GPU

# FakeTensorMode's tensors carry a device, shape and dtype but no data, and it checks every operation's
# devices as CUDA would. A CPU-only torch lacks two pieces fake CUDA tensors need: a device guard (indexing
# and autograd switch to the tensor's device) and CUDA hooks that say CUDA is there. These are test
# doubles of both; no kernel ever runs on them.
FAKE_CUDA_SHIM = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

namespace fake_cuda {
struct CUDAHooks : at::CUDAHooksInterface {
  CUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  void init() const override {}
};
}  // namespace fake_cuda

namespace at {
using fake_cuda::CUDAHooks;
REGISTER_CUDA_HOOKS(CUDAHooks);  // under the name torch looks up, read when CUDA is first asked about
}
"""


@pytest.fixture(scope="module")
def fake_cuda_shim(tmp_path_factory):
    """The shim built for this torch (~2 s), or None where torch has CUDA built in and needs none."""
    if torch.backends.cuda.is_built():
        return None
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the fake CUDA device with")
    root = Path(torch.__file__).parent
    shim_dir = tmp_path_factory.mktemp("fake_cuda")
    (shim_dir / "shim.cpp").write_text(FAKE_CUDA_SHIM)
    flags = ["-std=c++17", "-O0", "-w", "-shared", "-fPIC", f"-I{root / 'include'}", f"-L{root / 'lib'}"]
    libraries = [f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu"]
    result = run([compiler, *flags, str(shim_dir / "shim.cpp"), *libraries, "-o", str(shim_dir / "shim.so")])
    assert result.returncode == 0, result.stderr
    return shim_dir / "shim.so"


@pytest.mark.process
def test_a_step_an_eval_and_generation_keep_every_tensor_on_the_gpu(fake_cuda_shim):
    """train.py's step (bf16 autocast, clipping, fused AdamW's on-device skip), its eval, generate (KV
    cache, top-k, top-p, a stop token, OneDNNLinear as on an AMD host), a chat step and a Muon step, on a
    fake CUDA device set up by runtime.setup; and a CPU batch meeting the GPU model is caught."""
    load = f"import ctypes; ctypes.CDLL({str(fake_cuda_shim)!r}, mode=ctypes.RTLD_GLOBAL); " if fake_cuda_shim else ""
    path = f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; "
    result = run_python(["-c", load + path + "import test_cuda_contract as t; t.trace_on_fake_cuda()"])
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines() == [
        "train_step: loss, grad_norm, stepped on cuda:0; weights and AdamW state on cuda:0",
        "evaluate: val",
        "generate: (2, 24) on cuda:0, through 5 OneDNNLinear",
        "chat train_step: loss, grad_norm, stepped on cuda:0",
        "chat evaluate: val",
        "muon train_step: stepped on cuda:0; 16 state tensors",
        "a CPU batch for the GPU model: devices cuda:0 and cpu",
    ]


def trace_on_fake_cuda():
    """The body of the test above, run in a process of its own (the shim cannot be unloaded)."""
    mode = FakeTensorMode()  # no real tensor may enter an operation uncaught
    from_numpy = torch.from_numpy

    def getitem(self, index):
        # a list in an index becomes an index tensor on the tensor's device, as torch does, but made
        # by a factory the fake mode sees (its values never matter: only the shape does)
        index = index if isinstance(index, tuple) else (index,)
        index = tuple(
            torch.zeros(len(i), dtype=torch.long, device=self.device) if isinstance(i, list) else i for i in index
        )
        return torch.Tensor.__getitem__(self, index)

    patches = [
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "device_count", lambda: 1),
        mock.patch.object(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True),
        mock.patch.object(torch.cuda, "set_device", lambda device: torch.cuda._get_device_index(device)),
        # host data (batches from numpy) enters as fake CPU tensors, so where it meets the GPU is checked
        mock.patch.object(torch, "from_numpy", lambda array: mode.from_tensor(from_numpy(array))),
        mock.patch.object(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self),  # none when faked
        mock.patch.object(FakeTensor, "__getitem__", getitem, create=True),
        # what the host reads (a loss, "has every row stopped?") has no value when faked: made up
        mock.patch.object(FakeTensor, "item", lambda self: 0.0, create=True),
        mock.patch.object(FakeTensor, "__bool__", lambda self: False, create=True),
    ]
    for patch in patches:
        patch.start()
    rt = runtime.setup("cuda", "bfloat16")
    # one block: a second one's operations are the first one's again, each costly when faked
    keys = dict(n_layer=1, n_head=4, n_kv_head=2, n_embd=32, block_size=16, bias=False, pos_encoding="rope")
    cfg = TrainConfig(**keys, batch_size=4, dropout=0.1, compile=False, grad_clip=1.0)
    torch.manual_seed(0)
    raw = GPT(GPTConfig(**build.make_model_args(cfg, 65)))  # built on the CPU, then made fake and moved to the GPU
    fakes = {}
    for module in raw.modules():
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in store.items():
                if t is None:
                    continue
                if id(t) not in fakes:  # wte and lm_head share one weight: one fake for both
                    fake = mode.from_tensor(t.detach())
                    with mode:
                        fake = fake.to(rt.device)
                    fakes[id(t)] = (t, torch.nn.Parameter(fake, t.requires_grad) if is_param else fake)
                store[name] = fakes[id(t)][1]
    data = (np.arange(5000) % 65).astype(np.uint16)
    on = lambda tensors: ", ".join(sorted({str(t.device) for t in tensors}))
    with mode:
        model, train_model, optimizer, scaler = build.build(raw, cfg, rt)
        step = lambda batches: train_step(train_model, optimizer, scaler, batches, 1e-3, 2, cfg.grad_clip, rt)
        result = step(TrainBatches(data, 4, 16, 0, rt))
        states = [v for s in optimizer.state.values() for v in s.values()]
        devices = on([*result, *raw.parameters(), *states])
        print(f"train_step: loss, grad_norm, stepped on {devices}; weights and AdamW state on {rt.device}")
        print("evaluate:", ", ".join(evaluate(model, {"val": (data, eval_offsets(data, 2, 4, 16, 0))}, 16, rt)))
        raw.eval()
        # as chat.py on a GPU machine with an AMD host: the eager matmuls stay nn.Linear's on the GPU
        swapped = cpu_matmuls.onednn_matmuls(raw, vendor="AuthenticAMD")
        prompt = torch.zeros(2, 4, dtype=torch.long, device=rt.device)
        with rt.autocast():
            out = sampling.generate(raw, prompt, 20, temperature=0.8, top_k=10, top_p=0.9, stop_token=3)
        linears = sum(type(m) is cpu_matmuls.OneDNNLinear for m in raw.modules()) if swapped else 0
        print(f"generate: {tuple(out.shape)} on {out.device}, through {linears} OneDNNLinear")
        for m in raw.modules():
            if type(m) is cpu_matmuls.OneDNNLinear:
                m.__class__ = torch.nn.Linear
        raw.train()
        # chat rows (batches.chat_batch): the summed loss weighted by the step's trained tokens
        chat = ChatData(data[:400], (np.arange(400) % 3 == 0).astype(np.uint8), np.arange(0, 400, 25))
        print(f"chat train_step: loss, grad_norm, stepped on {on(step(ChatBatches(chat, 4, 16, 0, rt, 2)))}")
        print("chat evaluate:", ", ".join(evaluate(model, {"val": (chat, chat_eval_offsets(chat, 2, 4, 0))}, 16, rt)))
        # Muon beside AdamW: on a GPU it orthogonalizes in bfloat16, with its on-device skip
        _, muon_model, muon_optimizer, muon_scaler = build.build(raw, dataclasses.replace(cfg, optimizer="muon"), rt)
        batches = TrainBatches(data, 4, 16, 0, rt)
        result = train_step(muon_model, muon_optimizer, muon_scaler, batches, 1e-3, 2, cfg.grad_clip, rt)
        states = [v for o in muon_optimizer.optimizers for s in o.state.values() for v in s.values()]
        print(f"muon train_step: stepped on {on([*result, *raw.parameters(), *states])}; {len(states)} state tensors")
        cpu = runtime.Runtime("cpu", "cpu", rt.dtype)
        try:
            step(lambda: get_batch(data, np.arange(4), 16, cpu))
        # torch 2.11 (the supported floor) raises a RuntimeError; FakeTensorDeviceMismatchError came later
        except getattr(fake_tensor, "FakeTensorDeviceMismatchError", RuntimeError) as e:
            caught = "cuda:0" in str(e) and "cpu" in str(e)
            print("a CPU batch for the GPU model:", "devices cuda:0 and cpu" if caught else e)


# ---------------------------------------------------------------------------- the other CUDA branches


def test_auto_batch_size_budgets_the_gpus_memory(monkeypatch):
    """On a GPU the budget is the device's memory: the same choice as that many bytes given as
    memory_budget_gb."""
    asked = []
    memory = lambda device: asked.append(device) or types.SimpleNamespace(total_memory=10 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", memory)
    keys = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, dropout=0.0, compile=False)
    cfg = TrainConfig(**keys, batch_size="auto", total_batch_size=64 * 64)
    model = GPT(GPTConfig(**build.make_model_args(cfg, 65)))
    gpu = runtime.Runtime("cpu", "cuda", torch.float32)  # measured on the CPU, budgeted as a GPU's
    on_gpu = auto_batch_size(model, cfg, gpu)
    cpu = runtime.Runtime("cpu", "cpu", torch.float32)
    given = auto_batch_size(model, dataclasses.replace(cfg, memory_budget_gb=10 / 1024), cpu)
    assert asked == ["cpu"] and on_gpu == given and 1 <= on_gpu < 64  # the budget binds


def test_the_stop_flag_of_gpu_ranks_travels_over_gloo(monkeypatch):
    """NCCL carries the gradients; the per-step stop flag goes over a gloo group of its own, made
    once, so ranks wait for each other's hosts, never for their GPUs."""
    groups, reduced = [], []
    new_group = lambda backend, timeout: groups.append((backend, timeout)) or "gloo-group"
    monkeypatch.setattr(torch.distributed, "new_group", new_group)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op, group: reduced.append((t.device.type, group)))
    rt = runtime.Runtime(
        "cuda:1", "cuda", torch.bfloat16, rank=1, local_rank=1, world_size=2, timeout=datetime.timedelta(seconds=42)
    )
    stop = stopping.StopRequest()
    try:
        assert stop.check(rt) is False and stop.check(rt) is False
    finally:
        stop.restore()
    assert groups == [("gloo", datetime.timedelta(seconds=42))]  # the run's dist_timeout_s, not gloo's 30 minutes
    assert reduced == [("cpu", "gloo-group")] * 2


def test_ddp_on_gpus_holds_the_gpu_of_the_local_rank(monkeypatch):
    wrapped = []
    ddp = lambda model, device_ids, **options: wrapped.append((device_ids, options)) or model
    monkeypatch.setattr(build, "DDP", ddp)
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, dropout=0.0, compile=False, parallelism="ddp")
    rt = runtime.Runtime("cpu", "cuda", torch.float32, rank=1, local_rank=1, world_size=2)  # weights stay on the CPU
    build.build(GPT(GPTConfig(**build.make_model_args(cfg, 65))), cfg, rt)
    assert wrapped == [([1], {"gradient_as_bucket_view": True})]


def test_an_in_loop_eval_out_of_memory_on_a_gpu_empties_the_cache_and_training_goes_on(monkeypatch, capsys):
    """train.downstream on a CUDA runtime: the failed eval's memory goes back to the device
    (torch.cuda.empty_cache, recorded here), the model is back in training mode, and the failure
    is one line and a record."""
    import train

    emptied, written = [], []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    model, ns = torch.nn.Linear(2, 2).eval(), types.SimpleNamespace
    run = ns(cfg=ns(eval_only=False), rt=runtime.Runtime("cuda:0", "cuda", torch.bfloat16), iter_num=7, raw_model=model)
    run.metrics, run.throughput = ns(write=written.append), ns(restart=lambda: None)

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    train.downstream(run, "hellaswag", out_of_memory)
    assert emptied == [True] and model.training
    failure = "OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB"
    assert written == [{"iter": 7, "hellaswag_failed": failure}]
    assert capsys.readouterr().out == f"step 7: hellaswag failed, training goes on ({failure})\n"
    run.rt = runtime.Runtime("cpu", "cpu", torch.float32)
    train.downstream(run, "core", out_of_memory)
    assert emptied == [True]  # a CPU run has no device cache to empty
