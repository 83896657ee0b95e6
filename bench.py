"""Measure train.py's own training step: ms/iter, tokens/s, TFLOPS, MFU and peak memory.

    python bench.py config/train_shakespeare_char_cpu.py                       # a CPU-sized model
    python bench.py --batch_size=12 --block_size=1024 --dtype=bfloat16         # GPT-2 124M (a GPU's job)
    python bench.py config/train_shakespeare_char_cpu.py --sweep=batch_size=4,8,16,32
    python bench.py config/train_shakespeare_char_cpu.py --sweep=dtype=float32,bfloat16
    python bench.py config/train_shakespeare_char_cpu.py --profile=True        # trace in out_dir/profile
    python bench.py --estimate_params=1.24e9                                   # time-to-train at the measured speed
    python bench.py ... --json=True                                            # last line: one JSON object

Every train.py key works here too (`python bench.py --help`). The step is train.py's
train_step on the model train.py builds; data is random tokens unless --data=real.
"""

import json
import os
import resource
import time

import numpy as np
import torch

import runtime
import tokenizer
import train
from configurator import BenchConfig, UserError, override, parse, run_main
from data import tokens
from model import GPT, GPTConfig


def bench_data(cfg):
    """(tokens, vocab_size): the real train split, or random tokens; the vocabulary is the
    dataset's when it has one (meta.json), else GPT-2's, as in train.py."""
    data_dir = os.path.join("data", cfg.dataset)
    vocab_size = tokenizer.vocab_size(tokenizer.describe(data_dir)) or 50304
    if cfg.data == "real":
        data = train.load_split(data_dir, "train", cfg.data_mode)
        data.check_vocab(vocab_size)
        return data, vocab_size
    if cfg.data != "synthetic":
        raise UserError(f"data='{cfg.data}' is not 'synthetic' or 'real'")
    size = max(1_000_000, 4 * cfg.block_size)
    return np.random.default_rng(0).integers(0, vocab_size, size=size).astype(tokens.dtype_for(vocab_size)), vocab_size


def peak_memory_mb(rt):
    """Peak memory of the run: the CUDA allocator's high-water mark, or on CPU the process's peak
    resident set (which includes the Python interpreter and libraries, ~0.3-0.5 GB)."""
    if rt.device_type == "cuda":
        return torch.cuda.max_memory_allocated(rt.device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(cfg, rt, data, vocab_size, profiler=None):
    """Time cfg.bench_iters optimizer steps after cfg.bench_warmup untimed ones."""
    torch.manual_seed(cfg.seed)
    raw_model = GPT(GPTConfig(**train.make_model_args(cfg, vocab_size))).to(rt.device)
    if cfg.batch_size == "auto":
        cfg = train.with_batch_size(cfg, train.auto_batch_size(raw_model, cfg, rt), cfg.total_batch_size)
    model, train_model, optimizer, scaler = train.build(raw_model, cfg, rt)
    batches = train.TrainBatches(data, cfg.batch_size, cfg.block_size, cfg.seed, rt)
    accum_steps = cfg.gradient_accumulation_steps // rt.world_size

    def step():
        return train.train_step(train_model, optimizer, scaler, batches, cfg.learning_rate, accum_steps, cfg.grad_clip, rt).loss

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
    peak = runtime.device_peak_flops(rt, cfg.peak_flops)
    return {
        "batch_size": cfg.batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "ms_per_iter": seconds * 1000,
        "tokens_per_s": tokens / seconds,
        "tflops": flops / seconds / rt.world_size / 1e12,  # per device
        "mfu": runtime.mfu(flops, seconds, peak, rt.world_size),
        "peak_mem_mb": peak_memory_mb(rt),
        "warmup_s": warmup_seconds,  # the untimed steps, compilation included
        "params": raw_model.num_params(),
        "flops_per_token": raw_model.flops_per_token(),
    }


def sweep_configs(cfg, spec, world_size):
    """'key=v1,v2' -> [(value text, cfg)]. Sweeping batch_size keeps the tokens per optimizer
    step of the base config and adjusts gradient accumulation; sizes that do not divide it are skipped."""
    key, sep, values = spec.partition("=")
    if not sep or not values:
        raise UserError(f"sweep='{spec}' should look like batch_size=4,8,16,32")
    out = []
    tokens_per_step = cfg.total_batch_size or cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    for text in values.split(","):
        swept = override(cfg, key, text)
        if key == "batch_size":
            rows = tokens_per_step // cfg.block_size
            if rows % (swept.batch_size * world_size):
                print(f"skipping batch_size={text}: does not divide {rows} sequences per step")
                continue
            swept = train.with_batch_size(swept, swept.batch_size, tokens_per_step)
        out.append((text, swept))
    return key, out


HEADER = f"{'':<20} batch x accum   ms/iter     tokens/s   TFLOPS    MFU   mem (MB)  warm-up (s)"


def format_row(label, r):
    if r is None:
        return f"{label:<20} out of memory"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    return (f"{label:<20} {r['batch_size']:>5} x {r['gradient_accumulation_steps']:<5} {r['ms_per_iter']:9.1f} "
            f"{r['tokens_per_s']:12,.0f} {r['tflops']:8.3g} {mfu:>6} {r['peak_mem_mb']:10,.0f} {r['warmup_s']:12.1f}")


def time_to_train(result, cfg, rt):
    """How long training N parameters on T tokens takes at the FLOP/s measured here (the same
    MFU, on the same number of devices); assumes the FLOPs per token scale as this model's do."""
    params = cfg.estimate_params or result["params"]
    tokens = cfg.estimate_tokens or 20 * params  # the compute-optimal ratio (Chinchilla)
    flops_per_token = result["flops_per_token"] * params / result["params"]
    seconds = flops_per_token * tokens / (result["tflops"] * 1e12 * rt.world_size)
    return {"estimate_params": params, "estimate_tokens": tokens, "estimate_flops": flops_per_token * tokens,
            "estimate_hours": seconds / 3600, "estimate_device_hours": seconds / 3600 * rt.world_size}


def main(argv=None):
    cfg = parse(BenchConfig, argv)
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.backend)
    try:
        run(cfg, rt)
    finally:
        runtime.teardown(rt)


def run(cfg, rt):
    data, vocab_size = bench_data(cfg)
    say = print if rt.master else (lambda *a, **k: None)
    device_name = torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    say(f"{device_name}, {str(rt.dtype).removeprefix('torch.')}, compile={cfg.compile}, {rt.world_size} rank(s); "
        f"{cfg.n_layer} layers x {cfg.n_embd} wide, block {cfg.block_size}; {cfg.bench_iters} timed steps after {cfg.bench_warmup}")

    if cfg.sweep:
        key, configs = sweep_configs(cfg, cfg.sweep, rt.world_size)
        rows = []
        for text, swept in configs:
            torch._dynamo.reset()  # compile each configuration afresh, not with shapes left from the last
            try:
                rows.append((f"{key}={text}", measure(swept, rt, data, vocab_size)))
            except torch.OutOfMemoryError:
                rows.append((f"{key}={text}", None))
            if rt.device_type == "cuda":
                torch.cuda.empty_cache()
        fitting = [r for r in rows if r[1] is not None]
        if not fitting:
            raise UserError("every configuration of the sweep ran out of memory")
        best = max(fitting, key=lambda r: r[1]["tokens_per_s"])
        say(HEADER)
        for label, r in rows:
            say(format_row(label, r) + ("  <- best" if (label, r) == best else ""))
        result = {**best[1], "best": best[0], "rows": [{"setting": label, **(r or {"oom": True})} for label, r in rows]}
    else:
        profiler = None
        if cfg.profile:
            trace_dir = os.path.join(cfg.out_dir, "profile")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if rt.device_type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=cfg.profile_wait, warmup=cfg.profile_warmup, active=cfg.profile_active),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir) if rt.master else None,
                record_shapes=True,
            )
        result = measure(cfg, rt, data, vocab_size, profiler)
        say(HEADER)
        say(format_row("", result))
        if profiler is not None and rt.master:
            sort = "cuda_time_total" if rt.device_type == "cuda" else "self_cpu_time_total"
            say(profiler.key_averages().table(sort_by=sort, row_limit=15))
            say(f"trace written to {trace_dir}: tensorboard --logdir {trace_dir}, or open the .pt.trace.json in chrome://tracing")

    if cfg.estimate_params or cfg.estimate_tokens:
        est = time_to_train(result, cfg, rt)
        result.update(est)
        mfu = f", MFU {result['mfu']:.1%}" if result["mfu"] is not None else ""
        say(f"time to train {est['estimate_params'] / 1e9:.3g}B parameters on {est['estimate_tokens'] / 1e9:.3g}B tokens "
            f"({est['estimate_flops']:.3g} FLOPs) at {result['tflops']:.3g} TFLOPS/device{mfu} on {rt.world_size} device(s): "
            f"{train.format_duration(est['estimate_hours'] * 3600)}, {est['estimate_device_hours']:,.1f} device-hours")
    if cfg.json:
        say(json.dumps(result))


if __name__ == "__main__":
    run_main(main)
