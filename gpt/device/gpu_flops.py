"""The dense peak FLOPS of a GPU (a table of datasheet numbers, matched by the device's name) and
model FLOPs utilization against it."""

import re

import torch

# Dense (never 2:4-sparse) tensor-core peaks in TFLOP/s from the vendors' datasheets and
# architecture whitepapers, as (bf16/fp16 with fp32 accumulation, tf32). float32 training uses the
# TF32 column because runtime.setup() turns TF32 matmuls on. GeForce cards run fp16/bf16 with fp32
# accumulation (what training uses) at half their fp16-accumulate rate, and TF32 at half that;
# data-centre and workstation cards run both at the full rate. Matched in order against
# torch.cuda.get_device_name(); `\b` keeps 'A10' from matching 'A100', 'L4' from 'L40S', 'L40'
# from 'L40S' and 'RTX 3060' from 'RTX 3060 Ti'. Laptop GPUs share names with desktop parts but
# not their clocks, so they are left unknown.
PEAK_TFLOPS = [
    # Hopper, Blackwell data-centre
    (r"H200 NVL", 835.5, 417.5),
    (r"H200", 989.4, 494.7),
    (r"H100 NVL", 835.5, 417.5),
    (r"H100 PCIe", 756.5, 378.0),
    (r"H100", 989.4, 494.7),  # SXM (reported as e.g. "NVIDIA H100 80GB HBM3")
    (r"GH200", 989.4, 494.7),
    (r"B200", 2250.0, 1125.0),
    # Ampere, Ada data-centre and workstation
    (r"A100", 312.0, 156.0),
    (r"A10\b", 125.0, 62.5),
    (r"A30\b", 165.0, 82.0),
    (r"A40\b", 149.7, 74.8),
    (r"L40S", 362.1, 183.0),
    (r"L40\b", 181.0, 90.5),
    (r"L4\b", 121.0, 60.0),
    (r"RTX A6000", 154.8, 77.4),
    (r"RTX A5000", 111.1, 55.6),
    (r"RTX A4000", 76.7, 38.4),
    (r"RTX 6000 Ada", 364.2, 182.1),
    # GeForce: fp32-accumulate rates
    (r"RTX 3060 Ti", 32.4, 16.2),
    (r"RTX 3060\b", 25.5, 12.7),
    (r"RTX 3070 Ti", 43.5, 21.7),
    (r"RTX 3070\b", 40.6, 20.3),
    (r"RTX 3080 Ti", 68.2, 34.1),
    (r"RTX 3080\b", 59.5, 29.8),
    (r"RTX 3090 Ti", 80.0, 40.0),
    (r"RTX 3090\b", 71.0, 35.6),
    (r"RTX 4060 Ti", 44.1, 22.1),
    (r"RTX 4060\b", 30.2, 15.1),
    (r"RTX 4070 Ti SUPER", 88.2, 44.1),
    (r"RTX 4070 Ti", 80.2, 40.1),
    (r"RTX 4070 SUPER", 71.0, 35.5),
    (r"RTX 4070\b", 58.3, 29.1),
    (r"RTX 4080 SUPER", 104.4, 52.2),
    (r"RTX 4080\b", 97.5, 48.7),
    (r"RTX 4090", 165.2, 82.6),
    (r"RTX 5090", 209.5, 104.8),
    # Volta and Turing: fp16 tensor cores only (no bf16, no TF32), so float32 runs at the FP32 rate
    (r"V100S", 130.0, 16.4),
    (r"V100-SXM", 125.0, 15.7),
    (r"V100", 112.0, 14.0),
    (r"T4\b", 65.0, 8.1),
]


def peak_flops(device_name, dtype):
    """Dense peak FLOP/s of one GPU for training in `dtype`, or None when unknown (then MFU
    is reported as n/a rather than against a wrong number)."""
    if "Laptop" in device_name:
        return None
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
