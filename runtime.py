"""What train.py, sample.py and bench.py share: device and precision choice, autocast,
distributed setup and teardown, and the dense peak FLOPS of the GPU for MFU."""

import os
import re
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from configurator import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Runtime:
    device: str  # e.g. 'cuda:0', 'cpu'
    device_type: str  # 'cuda', 'mps' or 'cpu'; what torch.autocast wants
    dtype: torch.dtype  # the autocast compute dtype (float32: no autocast)
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def master(self):
        return self.rank == 0

    @property
    def ddp(self):
        return self.world_size > 1

    def autocast(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


def pick_device(name):
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", name):
        raise UserError(f"device='{name}' is not a device; use auto, cpu, cuda, cuda:N or mps")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device='{name}' but no CUDA GPU is visible; use --device=cpu")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise UserError(f"device='{name}' but only {torch.cuda.device_count()} CUDA device(s) exist")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("device='mps' but MPS is not available here; use --device=cpu")
    return name


def pick_dtype(name, device_type):
    if name == "auto":
        if device_type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32  # CPU and MPS train in float32 unless asked otherwise
    if name not in DTYPES:
        raise UserError(f"dtype='{name}' is not supported; use auto, float32, bfloat16 or float16")
    if name == "bfloat16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("dtype='bfloat16' is not supported by this GPU; use --dtype=float16")
    return DTYPES[name]


def setup(device="auto", dtype="auto", backend="auto"):
    """Pick device and dtype, and join the process group when launched by torchrun."""
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    device = pick_device(device)
    device_type = device.split(":")[0]
    if world_size > 1:
        if backend == "auto":
            backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
        if device_type == "cuda":
            device = f"cuda:{local_rank}"
        else:
            # several ranks share this machine's cores; oversubscribing them is much slower
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if device_type == "cuda":
        torch.cuda.set_device(device)
        # TF32 matmuls on Ampere and newer: float32 work at tensor-core speed, ~10 bits of mantissa
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Runtime(device, device_type, pick_dtype(dtype, device_type), rank, local_rank, world_size)


def teardown(rt):
    if rt.ddp and dist.is_initialized():
        dist.destroy_process_group()


def synchronize(rt):
    """Wait for queued GPU work, so wall-clock timings measure the work itself."""
    if rt.device_type == "cuda":
        torch.cuda.synchronize()
    elif rt.device_type == "mps":
        torch.mps.synchronize()


# Dense (not 2:4-sparse) tensor-core peaks in FLOP/s for 16-bit training, from the vendors'
# datasheets; looked up by the substring torch.cuda.get_device_name() reports.
PEAK_FLOPS_16BIT = [
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM; checked after the PCIe/NVL names
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
]


def peak_flops(rt):
    """The GPU's dense bf16/fp16 peak for one device, or None when we do not know it."""
    if rt.device_type != "cuda" or rt.dtype == torch.float32:
        return None
    name = torch.cuda.get_device_name(rt.device)
    return next((peak for key, peak in PEAK_FLOPS_16BIT if key in name), None)
