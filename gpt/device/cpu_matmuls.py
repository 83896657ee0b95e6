"""The eager float32 matmuls of a CPU that is not Intel's: oneDNN's instead of MKL's, whose float32
products take a slower path there (on an AMD EPYC a 124M's forward over 1 to 40 tokens is 1.6-2x
faster, BENCHMARKS.md). serve.py, chat.py and sample.py call onednn_matmuls on the model they load,
so their greedy replies stay each other's. A compiled graph is inductor's either way."""

import torch
import torch.nn as nn


class OneDNNLinear(nn.Linear):
    """nn.Linear whose float32 product on a CPU, run eagerly, is oneDNN's (the kernel inductor's CPU
    graphs call) instead of MKL's. Traced by torch.compile, on another device or in another dtype,
    it is nn.Linear. The same parameters and state_dict."""

    def forward(self, x):
        if torch.compiler.is_compiling() or x.device.type != "cpu" or self.weight.dtype != torch.float32:
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def cpu_vendor():
    """This Linux CPU's vendor_id in /proc/cpuinfo ('GenuineIntel', 'AuthenticAMD', ...); '' elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def onednn_matmuls(model, vendor=None):
    """On a CPU that is not Intel's, where MKL's float32 matmuls take a slow path, make every
    nn.Linear of model a OneDNNLinear: a 124M's forward over 1 to 40 tokens 1.6-2x faster on an AMD
    EPYC (BENCHMARKS.md). Eager steps gain (serve.py's prompts, chat.py, sample.py); a compiled
    step is inductor's either way. On Intel's CPUs, or without oneDNN, nothing changes. vendor:
    cpu_vendor()'s answer (the default). Whether the matmuls are now oneDNN's."""
    vendor = cpu_vendor() if vendor is None else vendor
    if vendor in ("GenuineIntel", "") or not torch.backends.mkldnn.is_available():
        return False
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
    return True
