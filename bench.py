"""Measure the training step train.py runs (step.train_step on build.build's model): ms/iter,
tokens/s, TFLOPS, MFU and peak memory.

    python bench.py config/train_shakespeare_char_cpu.py                       # a CPU-sized model
    python bench.py --batch_size=12 --block_size=1024 --dtype=bfloat16         # GPT-2 124M (a GPU's job)
    python bench.py config/train_shakespeare_char_cpu.py --sweep=batch_size=4,8,16,32
    python bench.py config/train_shakespeare_char_cpu.py --sweep=dtype=float32,bfloat16
    python bench.py config/train_shakespeare_char_cpu.py --profile=True        # trace in out_dir/profile
    python bench.py --estimate_params=1.24e9                                   # time-to-train at the measured speed
    python bench.py ... --json=True                                            # last line: one JSON object
    python bench.py config/train_shakespeare_char_cpu.py --max_iters=500 --against="--mlp=swiglu" --seeds=5
    python bench.py config/train_shakespeare_char_cpu.py --compare="--optimizer=adamw" --against="--optimizer=muon" --target=1.9

Every train.py key works here too (`python bench.py --help`). The step is train.py's
train_step on the model train.py builds; data is random tokens unless --data=real. The standard
battery for a GPU (attention kernels, GPT-2 sweep, the 1B Llama, the baby GPT, correctness) is a
developer tool on the same measurement: scripts/gpu_battery.py.

--against=... compares two configurations instead (gpt/evaluation/compare.py): train.py runs each side (A:
this command's config plus --compare, B: plus --against) once per seed, interleaved, scores every
final checkpoint on the same val tokens, and reports means with 95% intervals, B - A with Welch's
p-value, the step-time ratio and, with --target, the iterations and time to that val loss;
compare.md, compare.json and compare.png go to --compare_dir.
"""

import json
import os
import sys

import torch

from configurator import BenchConfig, UserError, override, parse, run_main
from gpt.device import runtime
from gpt.evaluation import compare
from gpt.outdir.metrics import format_duration
from gpt.train import benchmark
from gpt.train.auto_batch import with_batch_size


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
            swept = with_batch_size(swept, swept.batch_size, tokens_per_step)
        out.append((text, swept))
    return key, out


HEADER = f"{'':<20} batch x accum   ms/iter     tokens/s   TFLOPS    MFU   mem (MB)  warm-up (s)"


def format_row(label, r):
    if r is None:
        return f"{label:<20} out of memory"
    return (
        f"{label:<20} {r['batch_size']:>5} x {r['gradient_accumulation_steps']:<5} {r['ms_per_iter']:9.1f} "
        f"{r['tokens_per_s']:12,.0f} {r['tflops']:8.3g} {benchmark.format_mfu(r['mfu']):>6} {r['peak_mem_mb']:10,.0f} "
        f"{r['warmup_s']:12.1f}"
    )


def time_to_train(result, cfg, rt):
    """How long training N parameters on T tokens takes at the FLOP/s measured here (the same
    MFU, on the same number of devices); assumes the FLOPs per token scale as this model's do."""
    params = cfg.estimate_params or result["params"]
    tokens = cfg.estimate_tokens or 20 * params  # the compute-optimal ratio (Chinchilla)
    flops_per_token = result["flops_per_token"] * params / result["params"]
    seconds = flops_per_token * tokens / (result["tflops"] * 1e12 * rt.world_size)
    return {
        "estimate_params": params,
        "estimate_tokens": tokens,
        "estimate_flops": flops_per_token * tokens,
        "estimate_hours": seconds / 3600,
        "estimate_device_hours": seconds / 3600 * rt.world_size,
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse(BenchConfig, argv)
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.backend, cfg.dist_timeout_s)
    try:
        if cfg.against:
            compare.run(cfg, argv, rt)  # the sides' train.py arguments start from this command's own
        else:
            run(cfg, rt)
    finally:
        runtime.teardown(rt)


def run(cfg, rt):
    data, vocab_size = benchmark.bench_data(cfg)
    say = print if rt.master else (lambda *a, **k: None)
    say(
        f"{benchmark.device_name(rt)}, {str(rt.dtype).removeprefix('torch.')}, compile={cfg.compile}, {rt.world_size} rank(s); "
        f"{cfg.n_layer} layers x {cfg.n_embd} wide, block {cfg.block_size}; {cfg.bench_iters} timed steps after {cfg.bench_warmup}"
    )

    if cfg.sweep:
        key, configs = sweep_configs(cfg, cfg.sweep, rt.world_size)
        rows = [(f"{key}={text}", benchmark.measure_or_oom(swept, rt, data, vocab_size)) for text, swept in configs]
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
            profiler = torch.profiler.profile(
                activities=benchmark.profiler_activities(rt),
                schedule=torch.profiler.schedule(
                    wait=cfg.profile_wait, warmup=cfg.profile_warmup, active=cfg.profile_active
                ),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir) if rt.master else None,
                record_shapes=True,
            )
        result = benchmark.measure(cfg, rt, data, vocab_size, profiler)
        say(HEADER)
        say(format_row("", result))
        if profiler is not None and rt.master:
            sort = "cuda_time_total" if rt.device_type == "cuda" else "self_cpu_time_total"
            say(profiler.key_averages().table(sort_by=sort, row_limit=15))
            say(
                f"trace written to {trace_dir}: tensorboard --logdir {trace_dir}, or open the .pt.trace.json in chrome://tracing"
            )

    if cfg.estimate_params or cfg.estimate_tokens:
        est = time_to_train(result, cfg, rt)
        result.update(est)
        mfu = f", MFU {result['mfu']:.1%}" if result["mfu"] is not None else ""
        say(
            f"time to train {est['estimate_params'] / 1e9:.3g}B parameters on {est['estimate_tokens'] / 1e9:.3g}B tokens "
            f"({est['estimate_flops']:.3g} FLOPs) at {result['tflops']:.3g} TFLOPS/device{mfu} on {rt.world_size} device(s): "
            f"{format_duration(est['estimate_hours'] * 3600)}, {est['estimate_device_hours']:,.1f} device-hours"
        )
    if cfg.json:
        say(json.dumps(result))


if __name__ == "__main__":
    run_main(main)
