"""What train.py, sample.py and bench.py share: device and precision choice, autocast, and
distributed setup and teardown (the process group)."""

import logging
import os
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

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
    timeout: timedelta = timedelta(seconds=600)  # of the process group and of every group made beside it

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
    if name == "bfloat16" and device_type == "mps" and not torch.backends.mps.is_macos_or_newer(14, 0):
        raise UserError("dtype='bfloat16' on MPS needs macOS 14 or newer; use --dtype=float16 or --dtype=float32")
    return DTYPES[name]


def setup(device="auto", dtype="auto", backend="auto", timeout_s=600):
    """Pick device and dtype, and join the process group when launched by torchrun. timeout_s
    bounds the wait to join (the store's connect, the other ranks' arrival) and every collective:
    a rank whose peer died fails after it instead of waiting for ever, so torchrun can restart
    the job (--max-restarts) or end it."""
    rank, local_rank, world_size = (
        int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1))
    )
    device = pick_device(device)
    device_type = device.split(":")[0]
    if device_type == "mps" and world_size > 1:
        raise UserError(
            "torchrun with device=mps: torch.distributed has no MPS backend; run one process "
            "(python train.py ...), or use --device=cpu"
        )
    if device_type == "cuda":
        if world_size > 1 or device == "cuda":
            # one GPU per process, by its local rank (0 outside torchrun): torch.cuda.set_device
            # wants an index, and the rest of the run uses this same string
            if local_rank >= torch.cuda.device_count():
                raise UserError(
                    f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                    f"start at most that many processes per machine (torchrun --nproc_per_node)"
                )
            device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
        # TF32 matmuls on Ampere and newer: float32 work at tensor-core speed, ~10 bits of mantissa
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world_size > 1:
        if backend == "auto":
            backend = "nccl" if device_type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        except dist.DistError as e:  # the store's connect or the other ranks' arrival timed out
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise UserError(
                f"rank {rank} of {world_size} gave up joining the process group at {where} after "
                f"dist_timeout_s={timeout_s} ({str(e).strip().splitlines()[0]}): start every rank, "
                f"or raise --dist_timeout_s"
            ) from None
        if (
            rank == 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0
        ):
            # torchrun keeps one store for every attempt; a restarted rank can read the previous
            # attempt's addresses there and fail to connect (pytorch/pytorch#135712)
            print(
                "note: torchrun --max-restarts with one store for every attempt: restarts can fail to connect; "
                "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/distributed.md)"
            )
        if device_type != "cuda":
            # several ranks share this machine's cores; oversubscribing them is much slower
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return Runtime(
        device, device_type, pick_dtype(dtype, device_type), rank, local_rank, world_size, timedelta(seconds=timeout_s)
    )


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


def to_device(t, rt):
    """One host-to-device copy; to a GPU from pinned memory, so it overlaps the queued GPU work."""
    return t.pin_memory().to(rt.device, non_blocking=True) if rt.device_type == "cuda" else t.to(rt.device)


@contextmanager
def quiet_import():
    """torchao logs a warning for each CUDA kernel library a CPU build of torch cannot load (float8
    training needs none of them), and torch one for an Enum torchao registers with the compiler."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
