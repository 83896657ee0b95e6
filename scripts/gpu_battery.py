"""The standard battery for a GPU, on bench.py's measurement (gpt/train/benchmark.py): the environment,
the SDPA kernel that runs and each kernel's speed, GPT-2 124M at four micro-batches, the 1B Llama
config with and without activation checkpointing, the baby GPT trained by train.py, and a
correctness smoke (bf16 against fp32, the KV cache against none, resume). report.md (the tables)
and report.json go to out_dir, rewritten after each part. A developer's tool: nothing imports it.

    python scripts/gpu_battery.py --out_dir=suite                                   # every part
    python scripts/gpu_battery.py --parts=env,attention --out_dir=suite       # some of its parts

On one GPU the whole battery takes ~25 minutes; these four commands each stay under 10 (the H100
estimates of tests/test_bench.py, from what each part runs: its FLOPs at 40% MFU, compilation,
start-up):

    python scripts/gpu_battery.py --parts=env,attention,smoke --out_dir=suite/1   # ~7 min
    python scripts/gpu_battery.py --parts=sweep --out_dir=suite/2                 # ~7 min
    python scripts/gpu_battery.py --parts=llama --out_dir=suite/3                 # ~5 min
    python scripts/gpu_battery.py --parts=baby --out_dir=suite/4                  # ~7 min

On a CPU the same parts run at tiny shapes in under a minute. Every bench.py key works here too
(`python scripts/gpu_battery.py --help`); --baby_iters shortens the baby run.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, REPO)
from configurator import BenchConfig, UserError, parse, require, run_main
from gpt.data import token_files  # after the path line above
from gpt.data.batches import TrainBatches
from gpt.device import gpu_flops, runtime
from gpt.inference import sampling
from gpt.train.auto_batch import with_batch_size
from gpt.train.benchmark import device_name, format_mfu, learnable, measure_or_oom, profiler_activities, synthetic
from gpt.train.build import build, make_model_args
from gpt.train.step import train_step
from model import GPT, GPTConfig


@dataclass
class BatteryConfig(BenchConfig):
    # every bench.py key, plus which parts run; report.md and report.json go to out_dir
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    parts: str = "env,attention,sweep,llama,baby,smoke"  # the parts to run, comma-separated (one 10-minute call each on an H100)
    baby_iters: int = 0  # part baby: train.py's steps; 0: the config's own on a GPU, 300 on a CPU
    # fmt: on

    def __post_init__(self):
        super().__post_init__()
        unknown = [p for p in self.parts.split(",") if p not in SUITE_PARTS]
        require(not unknown, f"parts: {', '.join(map(repr, unknown))} not among {', '.join(SUITE_PARTS)}")
        require(self.baby_iters >= 0, f"baby_iters={self.baby_iters} must be >= 0")


SUITE_PARTS = ("env", "attention", "sweep", "llama", "baby", "smoke")  # the parts, in the order they run

TARGET_VAL = 1.47  # the baby GPT's goal: nanoGPT's val loss after its full run


def suite_scale(rt):
    """The battery's shapes: the real ones on a GPU; on anything else tiny ones, so that the same
    code runs in seconds (tests, CI) and the report still has every section. suite_plan() turns
    them into what each part runs; tests/test_bench.py holds every part to 8 minutes on an H100."""
    if rt.device_type == "cuda":
        return dict(
            gpt2=dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, bias=False, dropout=0.0, compile=True),
            # math keeps T x T scores in memory: never the one to pick on a GPU
            vocab_size=50304,
            attention_batch=8,
            attention_kernels=("auto", "flash", "cudnn", "efficient"),
            sweep=(8, 16, 32, 64),
            sweep_tokens=524_288,
            # the config's 64 micro-steps (1M tokens) take ~24 s a step on an H100; two micro-batches
            # time the same shapes, accumulation included, within the part's budget
            llama_config="config/train_llama_1b.py",
            llama_vocab=128_256,
            llama_overrides=["--gradient_accumulation_steps=2"],
            baby_config="config/train_shakespeare_char.py",
            baby_overrides=[],
            baby_iters=0,
            smoke=dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=16),
            smoke_steps=30,
        )
    return dict(
        gpt2=dict(n_layer=2, n_head=4, n_embd=64, block_size=64, bias=False, dropout=0.0, compile=False),
        vocab_size=512,
        attention_batch=4,
        attention_kernels=("auto", "flash", "cudnn", "efficient", "math"),
        sweep=(4, 8, 16),
        sweep_tokens=2048,
        llama_config="config/train_llama_tiny.py",
        llama_vocab=512,
        llama_overrides=["--compile=False"],
        baby_config="config/train_shakespeare_char_cpu.py",
        baby_overrides=["--eval_interval=100", "--eval_iters=10"],
        baby_iters=300,
        smoke=dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=4),
        smoke_steps=8,
    )


def suite_row(label, r, **extra):
    """One report.json row: what measure() found, under a label."""
    keys = (
        "ms_per_iter",
        "tokens_per_s",
        "tflops",
        "mfu",
        "peak_mem_mb",
        "batch_size",
        "gradient_accumulation_steps",
        "warmup_s",
        "params",
    )
    return {"label": label, **({k: r[k] for k in keys} if r else {"error": "out of memory"}), **extra}


def part_env(cfg, rt, scale, report):
    env = {
        "device": report["device"],
        "torch": torch.__version__,
        "dtype": str(rt.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }
    if rt.device_type == "cuda":
        props = torch.cuda.get_device_properties(rt.device)
        peak = gpu_flops.device_peak_flops(rt, cfg.peak_flops)
        env.update(
            memory_gb=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            driver=nvidia_driver(),
            dense_peak_tflops=peak / 1e12 if peak else None,
        )
    report["env"] = env
    return "## Environment\n\n" + table(["key", "value"], [[k, v] for k, v in env.items()])


def nvidia_driver():
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


# Which SDPA kernel a profiler event belongs to, from its name: the aten operator (what the CPU side
# records) or the GPU kernel. First match wins, and the order matters: cuDNN's kernels have "flash"
# in their names too. Real names, as profiled and posted by users:
#   cudnn      aten::_scaled_dot_product_cudnn_attention; cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0
#              (H100, meta-pytorch/tritonbench#41); cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_...
#              and ..._sm90_flash_bprop_wgmma_f16_knob_26_... (H100 profiles of FSDP2 runs)
#   efficient  aten::_efficient_attention_forward; fmha_cutlassF_f32_aligned_64x128_rf_sm80 (GuigsEvt/dgx_spark_config#5),
#              fmha_cutlassB_bf16_aligned_128x128_k128_sm80
#   flash      aten::_flash_attention_forward; void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<...>>,
#              pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...> (huggingface/blog#3451: torch's
#              vendored FlashAttention-2); on a CPU aten::_scaled_dot_product_flash_attention_for_cpu
#   math       aten::_scaled_dot_product_attention_math (no kernel of its own: matmuls and a softmax)
SDPA_KINDS = [
    ("cudnn", re.compile(r"cudnn", re.I)),
    ("efficient", re.compile(r"fmha_cutlass|efficient_attention|mem_eff", re.I)),
    ("flash", re.compile(r"flash", re.I)),
    ("math", re.compile(r"_scaled_dot_product_attention_math", re.I)),
]


DISPATCH = re.compile(r"^autograd::|Backward0$|^aten::scaled_dot_product_attention$")  # wrappers around the kernels


def sdpa_kernel_kind(name):
    """'cudnn', 'efficient', 'flash' or 'math' for a profiler event of that SDPA kernel; None otherwise."""
    return next((kind for kind, pattern in SDPA_KINDS if pattern.search(name)), None)


def attention_configs(cfg, scale):
    """[(attention value, config)] that part attention times: the GPT-2 shape, one micro-batch."""
    base = dataclasses.replace(
        cfg,
        **scale["gpt2"],
        batch_size=scale["attention_batch"],
        gradient_accumulation_steps=1,
        profile_wait=1,
        profile_warmup=1,
        profile_active=1,
    )
    return [(name, dataclasses.replace(base, attention=name)) for name in scale["attention_kernels"]]


def part_attention(cfg, rt, scale, report):
    """Which SDPA kernel runs by default for the GPT-2 shape (named from the profiler's events), and
    ms/iter with each kernel this device has."""
    configs = attention_configs(cfg, scale)
    data = synthetic(scale["vocab_size"], configs[0][1].block_size)
    profiler = torch.profiler.profile(
        activities=profiler_activities(rt), schedule=torch.profiler.schedule(wait=1, warmup=1, active=1)
    )
    rows, notes = [], []
    for name, config in configs:
        try:
            r = measure_or_oom(config, rt, data, scale["vocab_size"], profiler if name == "auto" else None)
        except UserError as e:
            notes.append(f"{name}: unavailable ({e})")
            continue
        rows.append(suite_row(f"attention={name}", r, part="attention"))
    kernels = sorted(e.key for e in profiler.key_averages() if sdpa_kernel_kind(e.key) and not DISPATCH.search(e.key))
    kinds = sorted({sdpa_kernel_kind(k) for k in kernels})
    report["attention"] = {"default_kind": kinds, "default_kernels": kernels, "unavailable": notes}
    report["rows"] += rows
    fastest = min((r for r in rows if "ms_per_iter" in r), key=lambda r: r["ms_per_iter"])
    base = configs[0][1]
    return (
        "## Attention (GPT-2 shape, batch {}, T={})\n\nKernel that ran with attention=auto: {} ({})\n\n".format(
            base.batch_size,
            base.block_size,
            ", ".join(kinds) or "none found",
            ", ".join(f"`{k[:90]}`" for k in kernels),
        )
        + rows_table(rows)
        + "".join(f"\n- {n}" for n in notes)
        + f"\n\nFastest: {fastest['label']}\n"
    )


def sweep_suite_configs(cfg, scale):
    """[(label, config)] that part sweep times: GPT-2 at each micro-batch, the same tokens per step."""
    base = dataclasses.replace(cfg, **scale["gpt2"])
    return [(f"micro-batch {b}", with_batch_size(base, b, scale["sweep_tokens"])) for b in scale["sweep"]]


def part_sweep(cfg, rt, scale, report):
    configs = sweep_suite_configs(cfg, scale)
    base = configs[0][1]
    data = synthetic(scale["vocab_size"], base.block_size)
    rows = [suite_row(label, measure_or_oom(c, rt, data, scale["vocab_size"]), part="sweep") for label, c in configs]
    report["rows"] += rows
    return (
        f"## GPT-2 sweep ({base.n_layer} layers x {base.n_embd}, T={base.block_size}, compile={base.compile}, "
        f"{scale['sweep_tokens']:,} tokens per step)\n\n" + rows_table(rows)
    )


def llama_configs(cfg, scale):
    """[(label, config)] that part llama times: the Llama config without and with activation checkpointing."""
    base = parse(
        BenchConfig,
        [
            os.path.join(REPO, scale["llama_config"]),
            *scale["llama_overrides"],
            f"--bench_iters={cfg.bench_iters}",
            f"--bench_warmup={cfg.bench_warmup}",
            f"--peak_flops={cfg.peak_flops}",
        ],
    )
    return [
        (f"activation_checkpointing={c}", dataclasses.replace(base, activation_checkpointing=c)) for c in (False, True)
    ]


def part_llama(cfg, rt, scale, report):
    configs = llama_configs(cfg, scale)
    data = synthetic(scale["llama_vocab"], configs[0][1].block_size)
    rows = [suite_row(label, measure_or_oom(c, rt, data, scale["llama_vocab"]), part="llama") for label, c in configs]
    report["rows"] += rows
    tokens = configs[0][1].gradient_accumulation_steps * configs[0][1].batch_size * configs[0][1].block_size
    return (
        f"## {scale['llama_config']} ({tokens:,} tokens per optimizer step, vocabulary {scale['llama_vocab']:,})\n\n"
        + rows_table(rows)
    )


def baby_args(cfg, scale, device):
    """train.py's arguments for part baby: the baby config, trained for its own iterations on a GPU."""
    # --overwrite=True: a suite run again into the same out_dir replaces its own earlier baby run
    args = [
        os.path.join(REPO, scale["baby_config"]),
        f"--out_dir={os.path.join(cfg.out_dir, 'baby')}",
        f"--device={device}",
        "--overwrite=True",
        *scale["baby_overrides"],
    ]
    iters = cfg.baby_iters or scale["baby_iters"]
    if iters:
        warmup = min(parse(BenchConfig, [os.path.join(REPO, scale["baby_config"])]).warmup_iters, iters // 10)
        args += [f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--warmup_iters={warmup}"]
    return args


def part_baby(cfg, rt, scale, report):
    """The baby GPT trained by train.py itself: wall time (start-up and compilation included) to the
    first eval with val <= TARGET_VAL, and the final val. Reads data/shakespeare_char."""
    if not os.path.exists(os.path.join("data", "shakespeare_char", "train.bin")):
        report["baby"] = {"skipped": "no data/shakespeare_char/train.bin"}
        return "## Baby GPT\n\nskipped: run python data/shakespeare_char/prepare.py first\n"
    out_dir = os.path.join(cfg.out_dir, "baby")
    # -u: each line reaches us when train.py prints it, not when a block-buffered pipe fills,
    # so the time read beside an eval line is the time of that eval
    args = [sys.executable, "-u", os.path.join(REPO, "train.py"), *baby_args(cfg, scale, rt.device)]
    evals, start = [], time.perf_counter()
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        lines = []
        for line in proc.stdout:  # timed as each eval's line appears
            lines.append(line)
            m = re.match(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", line)
            if m:
                evals.append((int(m[1]), float(m[2]), time.perf_counter() - start))
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise UserError(
            f"suite part baby: train.py exited with {proc.returncode}: {lines[-1].strip() if lines else ''}"
        )
    hit = next((e for e in evals if e[1] <= TARGET_VAL), None)
    steps = [r for r in read_jsonl(os.path.join(out_dir, "metrics.jsonl")) if "dt_ms" in r][1:]  # past the first window
    baby = {
        "config": scale["baby_config"],
        "iters": evals[-1][0],
        "final_val": evals[-1][1],
        "wall_s": wall,
        "target_val": TARGET_VAL,
        "seconds_to_target": hit[2] if hit else None,
        "iter_at_target": hit[0] if hit else None,
        "ms_per_iter": float(np.median([r["dt_ms"] for r in steps])) if steps else None,
    }
    report["baby"] = baby
    reached = f"{hit[2]:.1f} s (iter {hit[0]})" if hit else "not reached"
    return f"## Baby GPT ({scale['baby_config']}, {baby['iters']} iters, trained by train.py)\n\n" + table(
        ["final val", f"time to val <= {TARGET_VAL}", "wall (s)", "ms/iter (median)"],
        [[f"{baby['final_val']:.4f}", reached, f"{wall:.1f}", fmt(baby["ms_per_iter"])]],
    )


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@contextmanager
def exact_float32():
    """TF32 off while inside (setup() turns it on for CUDA), then as it was: a float32 check of
    exactness must not round its matmuls to TF32's 10-bit mantissa."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


SMOKE_VOCAB, RESUME_AT = 65, 10  # part smoke: a character vocabulary; the resume check stops at step 10 of 20


def smoke_base(cfg, scale):
    return dataclasses.replace(
        cfg,
        **scale["smoke"],
        gradient_accumulation_steps=1,
        compile=False,
        dropout=0.0,
        bias=False,
        attention="auto",
        learning_rate=1e-3,
        grad_clip=1.0,
    )


def part_smoke(cfg, rt, scale, report):
    """Correctness on this device: bf16 autocast tracks fp32 over the first steps; greedy decoding
    with the KV cache equals decoding without it (fp32, TF32 off); a resumed run continues with the
    same losses."""
    base = smoke_base(cfg, scale)
    vocab = SMOKE_VOCAB
    data = learnable(vocab)
    checks = {}

    def losses(dtype):
        rt_d = dataclasses.replace(rt, dtype=dtype)
        torch.manual_seed(cfg.seed)
        raw = GPT(GPTConfig(**make_model_args(base, vocab))).to(rt.device)
        _, model, optimizer, scaler = build(raw, base, rt_d)
        batches = TrainBatches(data, base.batch_size, base.block_size, cfg.seed, rt_d)
        out = [
            train_step(model, optimizer, scaler, batches, base.learning_rate, 1, base.grad_clip, rt_d).loss
            for _ in range(scale["smoke_steps"])
        ]
        return torch.stack(out).tolist(), raw

    fp32, model = losses(torch.float32)
    bf16, _ = losses(torch.bfloat16)
    gap = max(abs(a - b) for a, b in zip(fp32, bf16))
    checks["bf16_tracks_fp32"] = {"max_abs_loss_gap": gap, "tolerance": 0.05, "ok": gap <= 0.05}

    model.eval()
    prompt = torch.as_tensor(data[: base.block_size // 4].astype(np.int64), device=rt.device)[None]
    new = min(2 * base.block_size, 200)  # past block_size: the window slides too
    with torch.no_grad(), exact_float32():
        cached = sampling.generate(model, prompt, new, temperature=0, kv_cache=True)
        uncached = sampling.generate(model, prompt, new, temperature=0, kv_cache=False)
    same = int((cached == uncached).all(dim=0).long().cumprod(0).sum()) - prompt.size(1)
    checks["kv_cache_greedy_equals_uncached"] = {"tokens": new, "identical_prefix": same, "ok": same == new}

    checks["resume_same_losses"] = resume_check(cfg, rt, base, vocab)
    report["smoke"] = checks
    rows = [
        [name, "ok" if c["ok"] else "FAILED", ", ".join(f"{k}={fmt(v)}" for k, v in c.items() if k != "ok")]
        for name, c in checks.items()
    ]
    return "## Correctness smoke\n\n" + table(["check", "result", "detail"], rows)


def resume_check(cfg, rt, base, vocab):
    """train.py straight for 2k steps, and for k steps then resumed to 2k: the logged losses agree
    (bit-exactly on a CPU; on a GPU the embedding backward's atomic adds make the last bits vary)."""
    root = os.path.join(cfg.out_dir, "resume")
    data_dir = os.path.join(root, "data")
    os.makedirs(data_dir, exist_ok=True)
    ids = learnable(vocab)
    for split, part in (("train", ids[: len(ids) * 9 // 10]), ("val", ids[len(ids) * 9 // 10 :])):
        token_files.write(os.path.join(data_dir, f"{split}.bin"), part)
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump({"chars": "".join(chr(48 + i) for i in range(vocab))}, f)  # a character vocabulary of that size
    k = RESUME_AT
    common = [
        f"--device={rt.device}",
        f"--dtype={str(rt.dtype).removeprefix('torch.')}",
        "--compile=False",
        f"--dataset={os.path.abspath(data_dir)}",
        f"--n_layer={base.n_layer}",
        f"--n_head={base.n_head}",
        f"--n_embd={base.n_embd}",
        f"--block_size={base.block_size}",
        f"--batch_size={base.batch_size}",
        "--gradient_accumulation_steps=1",
        "--dropout=0.1",
        "--eval_interval=5",
        "--eval_iters=2",
        "--log_interval=1",
        f"--lr_decay_iters={2 * k}",
        "--warmup_iters=2",
    ]
    # the fresh starts overwrite an earlier suite's runs in this out_dir; the resume continues this one's
    runs = [
        ("straight", 2 * k, ["--overwrite=True"]),
        ("split", k, ["--overwrite=True"]),
        ("split", 2 * k, ["--init_from=resume"]),
    ]
    for name, iters, extra in runs:
        result = subprocess.run(
            [
                sys.executable,
                os.path.join(REPO, "train.py"),
                *common,
                f"--out_dir={os.path.join(root, name)}",
                f"--max_iters={iters}",
                *extra,
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            return {"ok": False, "error": (result.stderr.strip().splitlines() or ["?"])[-1]}
    loss_of = lambda name: {
        r["iter"]: r["loss"] for r in read_jsonl(os.path.join(root, name, "metrics.jsonl")) if "loss" in r
    }
    straight, split = loss_of("straight"), loss_of("split")
    gap = max(abs(straight[i] - split[i]) for i in straight) if straight.keys() == split.keys() else float("inf")
    tolerance = 0.0 if rt.device_type == "cpu" else 1e-3
    return {"steps": 2 * k, "resumed_at": k, "max_abs_loss_gap": gap, "tolerance": tolerance, "ok": gap <= tolerance}


SUITE = {
    "env": part_env,
    "attention": part_attention,
    "sweep": part_sweep,
    "llama": part_llama,
    "baby": part_baby,
    "smoke": part_smoke,
}


def suite_plan(cfg, scale):
    """What each part of the suite runs, to estimate its time: {part: [one dict per configuration]}
    with label; steps (optimizer steps, warm-up included) of tokens_per_step tokens; forward_passes
    (forward only: evals, generation) of tokens_per_forward tokens; flops_per_token (training FLOPs
    per token, model.flops_per_token(), 4/3 of it with activation checkpointing, which runs each
    forward twice); params; compiled; processes (Python processes it starts)."""

    def row(label, c, vocab, steps, forward_passes=0, tokens_per_forward=0, processes=0):
        with torch.device("meta"):  # the shape only: no memory, even for the 1B
            model = GPT(GPTConfig(**make_model_args(c, vocab)))
        return dict(
            label=label,
            steps=steps,
            tokens_per_step=c.gradient_accumulation_steps * c.batch_size * c.block_size,
            forward_passes=forward_passes,
            tokens_per_forward=tokens_per_forward,
            flops_per_token=model.flops_per_token() * (4 / 3 if c.activation_checkpointing else 1),
            params=model.num_params(),
            compiled=c.compile,
            processes=processes,
        )

    timed = lambda c: c.bench_warmup + c.bench_iters
    profiled = lambda c: c.profile_wait + c.profile_warmup + c.profile_active
    baby = parse(BenchConfig, baby_args(cfg, scale, "cuda"))
    baby_evals = baby.max_iters // baby.eval_interval + 1  # at 0, every eval_interval, and the end; train and val
    smoke = smoke_base(cfg, scale)
    new = min(2 * smoke.block_size, 200)
    k = RESUME_AT  # train.py for 2k steps, for k, then resumed to 2k; an eval of 2 batches every 5 steps
    return {
        "env": [],
        "attention": [
            row(f"attention={name}", c, scale["vocab_size"], timed(c) + (profiled(c) if name == "auto" else 0))
            for name, c in attention_configs(cfg, scale)
        ],
        "sweep": [row(label, c, scale["vocab_size"], timed(c)) for label, c in sweep_suite_configs(cfg, scale)],
        "llama": [row(label, c, scale["llama_vocab"], timed(c)) for label, c in llama_configs(cfg, scale)],
        "baby": [
            row(
                f"train.py {scale['baby_config']}",
                baby,
                SMOKE_VOCAB,
                baby.max_iters,
                forward_passes=2 * baby_evals * baby.eval_iters,
                tokens_per_forward=baby.batch_size * baby.block_size,
                processes=1,
            )
        ],
        "smoke": [
            row("fp32 and bf16 steps", smoke, SMOKE_VOCAB, 2 * scale["smoke_steps"]),
            row(
                "greedy decoding, with and without the cache",
                smoke,
                SMOKE_VOCAB,
                0,
                forward_passes=2 * new,
                tokens_per_forward=smoke.block_size,
            ),
            row(
                "train.py straight, split and resumed",
                smoke,
                SMOKE_VOCAB,
                4 * k,
                forward_passes=2 * 2 * (2 * k // 5 + 1 + k // 5 + 1 + k // 5 + 1),
                tokens_per_forward=smoke.batch_size * smoke.block_size,
                processes=3,
            ),
        ],
    }


def fmt(v):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]) + "\n"


def rows_table(rows):
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["label"], r["error"], "", "", "", "", ""])
            continue
        out.append(
            [
                r["label"],
                f"{r['batch_size']} x {r['gradient_accumulation_steps']}",
                f"{r['ms_per_iter']:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tflops']:.3g}",
                format_mfu(r["mfu"]),
                f"{r['peak_mem_mb']:,.0f}",
            ]
        )
    return table(["", "batch x accum", "ms/iter", "tokens/s", "TFLOPS", "MFU", "peak mem (MB)"], out)


def run_suite(cfg, rt):
    """Every part in cfg.parts, in order; report.md and report.json are rewritten after each
    part, so a part that runs out of time leaves the others' results."""
    device = device_name(rt)
    report = {"device": device, "torch": torch.__version__, "parts": cfg.parts.split(","), "rows": []}
    scale = suite_scale(rt)
    os.makedirs(cfg.out_dir, exist_ok=True)
    sections = [f"# scripts/gpu_battery.py: {device}, torch {torch.__version__}\n"]
    for part in report["parts"]:
        start = time.perf_counter()
        sections.append(SUITE[part](cfg, rt, scale, report))
        report.setdefault("seconds", {})[part] = time.perf_counter() - start
        print(sections[-1], flush=True)
        with open(os.path.join(cfg.out_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(cfg.out_dir, "report.md"), "w") as f:
            f.write("\n".join(sections))
    print(f"wrote {cfg.out_dir}/report.md and report.json")
    return report


def main(argv=None):
    cfg = parse(BatteryConfig, argv)
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.backend, cfg.dist_timeout_s)
    try:
        run_suite(cfg, rt)
    finally:
        runtime.teardown(rt)


if __name__ == "__main__":
    run_main(main)
