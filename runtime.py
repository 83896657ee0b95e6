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


def teardown(rt, all_finished=False):
    """Leave the process group. When every rank finished normally they first wait for each
    other: a rank that exits while another still talks to it over gloo can abort the other."""
    if rt.ddp and dist.is_initialized():
        if all_finished:
            dist.barrier()
        dist.destroy_process_group()


def synchronize(rt):
    """Wait for queued GPU work, so wall-clock timings measure the work itself."""
    if rt.device_type == "cuda":
        torch.cuda.synchronize()
    elif rt.device_type == "mps":
        torch.mps.synchronize()


# Dense (never 2:4-sparse) tensor-core peaks in TFLOP/s from the vendors' datasheets, as
# (bf16/fp16 with fp32 accumulation, tf32). float32 training uses the TF32 column because setup()
# turns TF32 matmuls on. Matched in order against torch.cuda.get_device_name(); the patterns keep
# 'A10' from matching 'A100' and 'L4' from matching 'L40S'.
PEAK_TFLOPS = [
    (r"H200 NVL", 835.5, 417.5),
    (r"H200", 989.4, 494.7),
    (r"H100 NVL", 835.5, 417.5),
    (r"H100 PCIe", 756.5, 378.0),
    (r"H100", 989.4, 494.7),  # SXM (reported as e.g. "NVIDIA H100 80GB HBM3")
    (r"A100", 312.0, 156.0),
    (r"A10\b", 125.0, 62.5),
    (r"L40S", 362.1, 183.0),
    (r"L4\b", 121.0, 60.0),
    (r"RTX 3090", 71.0, 35.6),  # GeForce: fp32 accumulation runs at half the fp16-accumulate rate
    (r"RTX 4090", 165.2, 82.6),
    (r"RTX 5090", 209.5, 104.8),
]


def peak_flops(device_name, dtype):
    """Dense peak FLOP/s of one GPU for training in `dtype`, or None when unknown (then MFU
    is reported as n/a rather than against a wrong number)."""
    for pattern, bf16, tf32 in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return (tf32 if dtype == torch.float32 else bf16) * 1e12
    return None


def device_peak_flops(rt, override=0.0):
    """The peak for this run's device: the `peak_flops` key when set, else the table (CUDA only;
    CPUs have no meaningful single peak, so their MFU is n/a and achieved TFLOPS is shown)."""
    if override > 0:
        return override
    if rt.device_type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(rt.device), rt.dtype)


def mfu(flops_per_iter, seconds_per_iter, peak, world_size=1):
    """Model FLOPs utilization: achieved over peak. The work of one iteration is spread over
    world_size devices, so the peak is theirs together (without this, 8 GPUs show 8x MFU)."""
    if not peak:
        return None
    return flops_per_iter / seconds_per_iter / (peak * world_size)
