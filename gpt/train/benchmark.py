"""Timing the training step train.py runs: what bench.py and the scripts that measure on a GPU
(gpu_battery.py, fp8_bench.py) share. The data a measurement reads (random tokens, or learnable
ones), the measurement itself (ms/iter, tokens/s, TFLOPS, MFU, peak memory), and a configuration
that does not fit reported as such rather than raised."""

import gc
import os
import resource
import time

import numpy as np
import torch

from configurator import UserError
from gpt.data import token_files, tokenizer
from gpt.data.batches import end_of_text, for_training, load_split
from gpt.device import gpu_flops, runtime
from gpt.train.auto_batch import settle_batch_size
from gpt.train.build import build, make_model_args
from gpt.train.step import train_step
from model import GPT, GPTConfig


def synthetic(vocab_size, block_size, seed=0, eot=None):
    """Random tokens, enough for any batch of block_size sequences. With eot, documents too: an
    end-of-text where each token has a 1 in block_size chance of being one, so a row holds about
    two documents (FineWeb's average document, ~1,000 tokens, in GPT-2's 1,024-token rows)."""
    size = max(1_000_000, 4 * block_size)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, vocab_size, size=size).astype(token_files.dtype_for(vocab_size))
    if eot is not None:
        data[rng.random(size) < 1 / block_size] = eot
    return data


def learnable(vocab_size, period=997, repeats=1000):
    """Random tokens repeated with a fixed period: a model learns them, so losses fall and greedy
    decoding has real continuations to produce."""
    return np.tile(np.random.default_rng(0).integers(0, vocab_size, size=period), repeats).astype(
        token_files.dtype_for(vocab_size)
    )


def document_eot(cfg, vocab_size):
    """The end-of-text id that batch_order='documents' and doc_mask find documents by, as train.py
    finds it in real data; for synthetic data the last id; None when neither key is set."""
    if cfg.batch_order != "documents" and not cfg.doc_mask:
        return None
    if cfg.data == "real":
        data_dir = os.path.join("data", cfg.dataset)
        return end_of_text(cfg, tokenizer.describe(data_dir), data_dir)
    return vocab_size - 1


def bench_data(cfg):
    """(tokens, vocab_size): the real train split, or random tokens; the vocabulary is the
    dataset's when it has one (meta.json), else GPT-2's, as in train.py."""
    data_dir = os.path.join("data", cfg.dataset)
    vocab_size = tokenizer.vocab_size(tokenizer.describe(data_dir)) or 50304
    if cfg.data == "real":
        # a copy per local rank
        data = load_split(data_dir, "train", cfg.data_mode, share=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        data.check_vocab(vocab_size)
        return data, vocab_size
    if cfg.data != "synthetic":
        raise UserError(f"data='{cfg.data}' is not 'synthetic' or 'real'")
    return synthetic(vocab_size, cfg.block_size, eot=document_eot(cfg, vocab_size)), vocab_size


def peak_memory_mb(rt):
    """Peak memory of the run: the CUDA allocator's high-water mark, or on CPU the process's peak
    resident set (which includes the Python interpreter and libraries, ~0.3-0.5 GB)."""
    if rt.device_type == "cuda":
        return torch.cuda.max_memory_allocated(rt.device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(cfg, rt, data, vocab_size, profiler=None):
    """Time cfg.bench_iters optimizer steps after cfg.bench_warmup untimed ones, on batches drawn
    as training draws them (batch_order, doc_mask)."""
    torch.manual_seed(cfg.seed)
    raw_model = GPT(GPTConfig(**make_model_args(cfg, vocab_size))).to(rt.device)
    cfg = settle_batch_size(cfg, raw_model, rt)
    model, train_model, optimizer, scaler = build(raw_model, cfg, rt)
    accum_steps = cfg.gradient_accumulation_steps // rt.world_size
    batches = for_training(data, cfg, rt, accum_steps, document_eot(cfg, vocab_size), say=lambda message: None)

    def step():
        return train_step(
            train_model, optimizer, scaler, batches, cfg.learning_rate, accum_steps, cfg.grad_clip, rt
        ).loss

    if profiler is not None:
        with profiler:
            for _ in range(cfg.profile_wait + cfg.profile_warmup + cfg.profile_active):
                step()
                profiler.step()
    warmup_start = time.perf_counter()
    for _ in range(cfg.bench_warmup):
        step()
    runtime.synchronize(rt)  # the clock starts with the device idle...
    warmup_seconds = time.perf_counter() - warmup_start
    if rt.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)
    start = time.perf_counter()
    for _ in range(cfg.bench_iters):
        loss = step()
    loss.item()
    runtime.synchronize(rt)  # ...and stops when the device has finished the last step
    seconds = (time.perf_counter() - start) / cfg.bench_iters
    tokens = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    flops = raw_model.flops_per_token() * tokens
    peak = gpu_flops.device_peak_flops(rt, cfg.peak_flops)
    return {
        "batch_size": cfg.batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "ms_per_iter": seconds * 1000,
        "tokens_per_s": tokens / seconds,
        "tflops": flops / seconds / rt.world_size / 1e12,  # per device
        "mfu": gpu_flops.mfu(flops, seconds, peak, rt.world_size),
        "peak_mem_mb": peak_memory_mb(rt),
        "warmup_s": warmup_seconds,  # the untimed steps, compilation included
        "params": raw_model.num_params(),
        "flops_per_token": raw_model.flops_per_token(),
    }


# cuBLAS and cuDNN report a failed allocation as a RuntimeError of their own, not as torch's
# OutOfMemoryError (e.g. "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
OOM_MESSAGES = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "out of memory")


def measure_or_oom(cfg, rt, data, vocab_size, profiler=None):
    """measure(cfg), or None when the configuration does not fit in the device's memory; the next
    one starts with the memory freed and compiles afresh."""
    torch._dynamo.reset()
    try:
        return measure(cfg, rt, data, vocab_size, profiler)
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        if not (isinstance(e, torch.OutOfMemoryError) or any(m in str(e) for m in OOM_MESSAGES)):
            raise
        return None
    finally:
        gc.collect()  # the failed step's tensors live in reference cycles (its frames) until collected...
        if rt.device_type == "cuda":
            torch.cuda.empty_cache()  # ...and only then can the allocator hand their blocks back


def device_name(rt):
    """The GPU's name, or the CPU and the threads torch uses on it."""
    return (
        torch.cuda.get_device_name(rt.device)
        if rt.device_type == "cuda"
        else f"CPU ({torch.get_num_threads()} threads)"
    )


def format_mfu(mfu):
    return f"{mfu:.1%}" if mfu is not None else "n/a"  # None: no known peak for this device


def profiler_activities(rt):
    """What torch.profiler records on rt's device: the CPU's operators, and the GPU's kernels."""
    return [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if rt.device_type == "cuda" else []
    )
