"""FP8 against the same run without it, on one GPU (docs/fp8.md): part speed times train.py's step
(bench.py's measurement) of the 1B Llama config and of GPT-2 124M with fp8=False and fp8=True at
the same shapes; part loss trains the 1B from the same init on the same learnable tokens for 200
steps each way and puts the two loss curves side by side. report.md and report.json go to
out_dir, rewritten after each part. A developer's tool: nothing imports it.

    python scripts/fp8_bench.py --parts=speed --bench_iters=5 --bench_warmup=1 --out_dir=fp8                 # ~6 min on an H100
    python scripts/fp8_bench.py --parts=loss --out_dir=fp8/loss                                              # ~6 min
    python scripts/fp8_bench.py --parts=speed --bench_iters=5 --bench_warmup=1 --fp8_skip= --out_dir=fp8/lm_head   # lm_head too

(the estimates as tests/test_bench.py makes them for the battery: 40% MFU, 90 s to compile the 1B,
60 s GPT-2). The goal: 1.15x the tokens/s of the 1B, with the loss at the last step within 1%.
Every bench.py key works here too (`python scripts/fp8_bench.py --help`); fp8_skip applies to the
fp8 side. On a GPU without FP8 units it stops with fp8's one-line refusal; on a CPU the same parts
run at tiny shapes with fp8='emulate' in seconds.
"""

import dataclasses
import gc
import importlib.metadata
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, REPO)
from configurator import BenchConfig, parse, require, run_main
from gpt.data.batches import TrainBatches
from gpt.device import runtime  # after the path line above
from gpt.train.benchmark import device_name, format_mfu, learnable, measure_or_oom, synthetic
from gpt.train.build import build, make_model_args
from gpt.train.optim import get_lr
from gpt.train.step import train_step
from model import GPT, GPTConfig

PARTS = ("speed", "loss")
GOAL_SPEEDUP, GOAL_LOSS_GAP = 1.15, 0.01  # the 1B: tokens/s against fp8=False, and the last step's loss


@dataclass
class Fp8BenchConfig(BenchConfig):
    # every bench.py key, plus which parts run; report.md and report.json go to out_dir
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    parts: str = "speed,loss"  # 'speed' (tokens/s of the 1B and GPT-2 124M, without and with fp8), 'loss' (the 1B's loss curves side by side), comma-separated
    loss_steps: int = 0  # part loss: the training steps of each side; 0: 200 on a GPU, 8 elsewhere
    # fmt: on

    def __post_init__(self):
        super().__post_init__()
        unknown = [p for p in self.parts.split(",") if p not in PARTS]
        require(not unknown, f"parts: {', '.join(map(repr, unknown))} not among {', '.join(PARTS)}")
        require(self.loss_steps >= 0, f"loss_steps={self.loss_steps} must be >= 0 (0: the device's default)")


def shapes(rt):
    """What the parts run: the real shapes on a GPU (the FP8 units); tiny ones elsewhere, with
    fp8='emulate', so that the same code runs in seconds (tests)."""
    if rt.device_type == "cuda":
        return dict(
            fp8=True,
            # part llama's shape in gpu_battery.py: the 1B config at two of its micro-batches (4 x 4096)
            llama=["config/train_llama_1b.py", "--gradient_accumulation_steps=2"],
            llama_vocab=128_256,
            gpt2=dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, bias=False, dropout=0.0, compile=True),
            gpt2_batch=16,
            gpt2_label="GPT-2 124M",
            vocab=50304,
            loss_steps=200,
        )
    return dict(
        fp8="emulate",
        llama=["config/train_llama_tiny.py", "--compile=False"],
        llama_vocab=512,
        gpt2=dict(n_layer=2, n_head=4, n_embd=64, block_size=64, bias=False, dropout=0.0, compile=False),
        gpt2_batch=4,
        gpt2_label="GPT-2's shape, small",
        vocab=512,
        loss_steps=8,
    )


def sides(cfg, base, shape):
    """[(label, config)]: base without fp8 and with it (cfg's fp8_skip)."""
    return [
        ("fp8=False", dataclasses.replace(base, fp8=False)),
        (f"fp8={shape['fp8']}", dataclasses.replace(base, fp8=shape["fp8"], fp8_skip=cfg.fp8_skip)),
    ]


def llama_base(cfg, shape):
    timing = [
        f"--bench_iters={cfg.bench_iters}",
        f"--bench_warmup={cfg.bench_warmup}",
        f"--peak_flops={cfg.peak_flops}",
    ]
    return parse(BenchConfig, [os.path.join(REPO, shape["llama"][0]), *shape["llama"][1:], *timing])


def speed_configs(cfg, shape):
    """{model: ([(label, config)], vocabulary)} that part speed times."""
    gpt2 = dataclasses.replace(cfg, **shape["gpt2"], batch_size=shape["gpt2_batch"], gradient_accumulation_steps=1)
    return {
        shape["llama"][0]: (sides(cfg, llama_base(cfg, shape), shape), shape["llama_vocab"]),
        shape["gpt2_label"]: (sides(cfg, gpt2, shape), shape["vocab"]),
    }


def part_speed(cfg, rt, shape, report):
    lines = ["## Speed: train.py's step without and with fp8\n"]
    for model, (configs, vocab) in speed_configs(cfg, shape).items():
        data = synthetic(vocab, configs[0][1].block_size)
        rows = []
        for label, c in configs:
            r = measure_or_oom(c, rt, data, vocab)
            rows.append({"model": model, "label": label, **(r or {"error": "out of memory"})})
        base, fp8 = rows
        speedup = fp8["tokens_per_s"] / base["tokens_per_s"] if "error" not in base and "error" not in fp8 else None
        goal = GOAL_SPEEDUP if model == shape["llama"][0] else None  # FP8 is not expected to pay at 124M
        report["speed"].append({"model": model, "rows": rows, "speedup": speedup, "goal": goal})
        c = configs[0][1]
        lines.append(
            f"### {model}: {c.batch_size} x {c.block_size} tokens x {c.gradient_accumulation_steps} micro-steps\n"
        )
        lines.append("| | ms/iter | tokens/s | TFLOPS | MFU | peak mem (MB) |\n|---|---|---|---|---|---|")
        for r in rows:
            cells = (
                [r["error"]] + [""] * 4
                if "error" in r
                else [
                    f"{r['ms_per_iter']:.1f}",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['tflops']:.3g}",
                    format_mfu(r["mfu"]),
                    f"{r['peak_mem_mb']:,.0f}",
                ]
            )
            lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
        ratio = f"{speedup:.3f}" if speedup else "none (a side did not fit)"
        lines.append(f"\ntokens/s with fp8 / without: {ratio}" + (f" (goal: {goal})\n" if goal else "\n"))
    return "\n".join(lines)


def loss_curve(c, rt, vocab, steps, seed):
    """The training loss of each of `steps` steps of config c, one micro-batch a step, on
    learnable tokens from seed's init: c's learning rate after a warmup of a tenth of the steps,
    then c's schedule down to min_lr at the last."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    raw = GPT(GPTConfig(**make_model_args(c, vocab))).to(rt.device)
    _, model, optimizer, scaler = build(raw, c, rt)
    batches = TrainBatches(learnable(vocab), c.batch_size, c.block_size, seed, rt)
    schedule = dataclasses.replace(c, warmup_iters=steps // 10, lr_decay_iters=steps, max_iters=steps)
    losses = [
        train_step(model, optimizer, scaler, batches, get_lr(it, schedule), 1, c.grad_clip, rt).loss
        for it in range(steps)
    ]
    return torch.stack(losses).tolist()


def part_loss(cfg, rt, shape, report):
    steps = cfg.loss_steps or shape["loss_steps"]
    base = dataclasses.replace(llama_base(cfg, shape), gradient_accumulation_steps=1)
    curves = {}
    for label, c in sides(cfg, base, shape):
        curves[label] = loss_curve(c, rt, shape["llama_vocab"], steps, cfg.seed)
        gc.collect()  # this side's model, optimizer and graphs, before the next side's
        if rt.device_type == "cuda":
            torch.cuda.empty_cache()
    (a_label, a), (b_label, b) = curves.items()
    gap = (b[-1] - a[-1]) / a[-1]
    report["loss"] = {
        "config": shape["llama"][0],
        "steps": steps,
        "tokens_per_step": base.batch_size * base.block_size,
        "curves": curves,
        "relative_gap_at_last_step": gap,
        "goal": GOAL_LOSS_GAP,
        "ok": abs(gap) <= GOAL_LOSS_GAP,
    }
    shown = sorted({1, steps // 4, steps // 2, 3 * steps // 4, steps} - {0})
    rows = [f"| {s} | {a[s - 1]:.4f} | {b[s - 1]:.4f} | {(b[s - 1] - a[s - 1]) / a[s - 1]:+.2%} |" for s in shown]
    return (
        f"## Loss: {shape['llama'][0]}, {steps} steps of {base.batch_size} x {base.block_size} learnable tokens, "
        f"the same init and batches\n\n| step | {a_label} | {b_label} | difference |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + f"\n\nat step {steps}: {gap:+.2%} (goal: within {GOAL_LOSS_GAP:.0%})\n"
    )


def main(argv=None):
    cfg = parse(Fp8BenchConfig, argv)
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.backend, cfg.dist_timeout_s)
    try:
        shape = shapes(rt)
        report = {"device": device_name(rt), "torch": torch.__version__, "parts": cfg.parts.split(","), "speed": []}
        report["torchao"] = importlib.metadata.version("torchao")
        os.makedirs(cfg.out_dir, exist_ok=True)
        sections = [
            f"# scripts/fp8_bench.py: {report['device']}, torch {torch.__version__}, torchao {report['torchao']}\n"
        ]
        for part in report["parts"]:
            start = time.perf_counter()
            sections.append({"speed": part_speed, "loss": part_loss}[part](cfg, rt, shape, report))
            report.setdefault("seconds", {})[part] = time.perf_counter() - start
            print(sections[-1], flush=True)
            with open(os.path.join(cfg.out_dir, "report.json"), "w") as f:
                json.dump(report, f, indent=2)
            with open(os.path.join(cfg.out_dir, "report.md"), "w") as f:
                f.write("\n".join(sections))
        print(f"wrote {cfg.out_dir}/report.md and report.json")
    finally:
        runtime.teardown(rt)


if __name__ == "__main__":
    run_main(main)
