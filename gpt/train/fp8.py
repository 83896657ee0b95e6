"""FP8 training through torchao: fp8=True turns the blocks' Linear layers into torchao's
Float8Linear, whose three matmuls (the forward, and backward's two) run on the GPU's FP8 units;
fp8='emulate' rounds to float8 the same way and multiplies in high precision, on any device.
build.build converts the model before it shards, compiles or wraps it.

    python train.py config/train_llama_1b.py --fp8=True                     # H100, H200, L4, RTX 4090 ...
    python bench.py config/train_llama_1b.py --fp8=True --bench_iters=3     # its tokens/s
    python train.py config/train_shakespeare_char_cpu.py --fp8=emulate      # float8's rounding on a CPU

The recipe is torchao's default: tensorwise dynamic scaling (one scale per tensor, from its
absolute maximum, each step), e4m3 for weights and activations, e5m2 for gradients. Only the
casts are float8: the weights, the optimizer and so every checkpoint stay as they were (fp32).
docs/fp8.md says which layers convert and why.
"""

import torch
import torch.nn as nn

from configurator import UserError
from gpt.device import runtime

# NVIDIA's first GPUs with FP8 tensor cores: Ada (8.9: L4, L40S, RTX 4090) and Hopper (9.0: H100, H200)
FP8_CAPABILITY = (8, 9)
INSTALL = "pip install torchao==0.17.0"  # requirements.txt's pin: built for torch 2.11 and later


def refusal(mode, device):
    """None when fp8=`mode` can train on `device`; otherwise the one line that says what to do.
    'emulate' runs on a CPU or any CUDA GPU; True needs a CUDA GPU with FP8 units."""
    if not mode:
        return None
    device = torch.device(device)
    if device.type == "mps":  # float8 tensors came to MPS late and in part (e4m3 first)
        return f"fp8={mode!r} needs float8 tensors, which MPS lacks: drop --fp8, or run --fp8=emulate with --device=cpu"
    if mode == "emulate":
        return None
    instead = "drop --fp8, or set --fp8=emulate to train with float8's rounding (not its speed) here"
    if device.type != "cuda":
        return f"fp8=True needs an NVIDIA GPU with FP8 units (compute capability 8.9+: L4, RTX 4090, H100, H200); this run is on {device.type}: {instead}"
    if torch.version.hip:
        return f"fp8=True is built for NVIDIA's FP8 units (CUDA compute capability 8.9+), not ROCm's: {instead}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (
            f"fp8=True needs FP8 units (compute capability 8.9+: L4, RTX 4090, H100, H200); {device} "
            f"({torch.cuda.get_device_name(device)}) is {capability[0]}.{capability[1]}: {instead}"
        )
    return None


def convert(model, mode, skip, device):
    """Swap model's Linear layers for torchao's Float8Linear in place: every Linear whose name
    contains none of the comma-separated parts in `skip` and whose two dims are multiples of 16.
    Returns (converted names, Linear names kept as they were). mode False: nothing converts."""
    if not mode:
        return [], []
    error = refusal(mode, device)
    if error:
        raise UserError(error)
    Float8LinearConfig, convert_to_float8_training, Float8Linear = import_float8()
    parts = [p.strip() for p in skip.split(",") if p.strip()]
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    unknown = [p for p in parts if not any(p in name for name in linears)]
    if unknown:
        raise UserError(
            f"fp8_skip={skip!r}: no Linear layer's name contains {', '.join(map(repr, unknown))} (the names are lm_head "
            f"and transformer.h.<i>.attn.c_attn, .attn.c_proj, .mlp.c_fc, .mlp.c_proj): fix it, or --fp8_skip=lm_head"
        )

    def eligible(module, name):
        # torch._scaled_mm, the float8 matmul, takes only inner and outer dims that are multiples of 16
        fits = module.in_features % 16 == 0 and module.out_features % 16 == 0
        return fits and not any(p in name for p in parts)

    # the default recipe, tensorwise dynamic scaling; emulate: the same casts, then a high-precision matmul
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=mode == "emulate"), module_filter_fn=eligible)
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    return converted, [name for name in linears if name not in converted]


def import_float8():
    """torchao's (Float8LinearConfig, convert_to_float8_training, Float8Linear), or the UserError
    that says how to install it."""
    try:
        with runtime.quiet_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:
        raise UserError(f"fp8 needs torchao ({e}): {INSTALL}, or drop --fp8")
    return Float8LinearConfig, convert_to_float8_training, Float8Linear
