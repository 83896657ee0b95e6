"""What train.py, sample.py and bench.py share: device and precision choice, autocast,
distributed setup and teardown, the host memory this job may still use (cgroup limits counted),
stop requests (SIGTERM, SIGINT, a time limit), and the dense peak FLOPS of the GPU for MFU."""

import os
import re
import signal
import time
from contextlib import nullcontext
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


# where free_memory reads the host's and the cgroup's numbers (the tests point these at fake files)
MEMINFO, SELF_CGROUP, CGROUP_ROOT = "/proc/meminfo", "/proc/self/cgroup", "/sys/fs/cgroup"


def free_memory():
    """Bytes of host memory this process may still take: the host's MemAvailable, lowered to what
    the tightest memory limit of its cgroup leaves (a Slurm job's, a Kubernetes pod's). Past that
    limit the kernel kills the job (exit -9, no message), however much the host has free."""
    host, left = _mem_available(), cgroup_memory_left()
    return host if left is None else min(host, left)


def _mem_available():
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB; free pages plus the cache the kernel can drop
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no /proc/meminfo (macOS): free pages
    except (ValueError, OSError, AttributeError):
        return 0  # unknown: stay with the memmap


# (limit, usage, the memory.stat key of reclaimable page cache) per cgroup version
CGROUP_FILES = {
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def cgroup_memory_left():
    """Bytes left under the tightest memory limit of this process's cgroup and its ancestors (a
    limit anywhere above applies too: Slurm sets it on the job, the process sits in a step below),
    in cgroup v2 or v1; None when no limit is set or nothing can be read. The inactive page cache
    counts as left: the kernel drops it before it kills."""
    try:
        with open(SELF_CGROUP) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    lefts = []
    for _, controllers, path in lines:
        if controllers == "":  # v2 (on a hybrid host its hierarchy is mounted at unified/)
            mounts, files = [CGROUP_ROOT, os.path.join(CGROUP_ROOT, "unified")], CGROUP_FILES["v2"]
        elif "memory" in controllers.split(","):
            mounts, files = [os.path.join(CGROUP_ROOT, "memory")], CGROUP_FILES["v1"]
        else:
            continue
        for mount in mounts:
            # the group and its ancestors; in a container whose mount is its own group, only the mount exists
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                left = _cgroup_left(os.path.join(mount, *parts[:depth]), *files)
                if left is not None:
                    lefts.append(left)
    return min(lefts) if lefts else None


def _cgroup_left(group, limit_file, usage_file, inactive_key):
    try:
        with open(os.path.join(group, limit_file)) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v2's "no limit", v1's (PAGE_COUNTER_MAX pages)
            return None
        with open(os.path.join(group, usage_file)) as f:
            usage = int(f.read())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        with open(os.path.join(group, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - usage + inactive)


class StopRequest:
    """SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C) only set a flag; the loop
    reads it between steps, writes a checkpoint and exits. A second Ctrl-C quits at once."""

    def __init__(self, max_minutes=0.0):
        self.reason, self.group = None, None
        self.deadline = time.monotonic() + 60 * max_minutes if max_minutes > 0 else None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name

    def check(self, rt):
        """True when this process should stop now; under DDP, when any rank should, so all agree."""
        if self.reason is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.reason = "max_minutes"
        stop = self.reason is not None
        if rt.ddp:
            # every step, so the flag travels on the host: over gloo (a group of its own when NCCL
            # carries the gradients) the ranks wait for each other, never for their GPUs
            if self.group is None:
                self.group = (
                    dist.new_group(backend="gloo", timeout=rt.timeout) if rt.device_type == "cuda" else dist.group.WORLD
                )
            flag = torch.tensor(float(stop))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            stop = bool(flag.item())
        return stop

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# Dense (never 2:4-sparse) tensor-core peaks in TFLOP/s from the vendors' datasheets and
# architecture whitepapers, as (bf16/fp16 with fp32 accumulation, tf32). float32 training uses the
# TF32 column because setup() turns TF32 matmuls on. GeForce cards run fp16/bf16 with fp32
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
