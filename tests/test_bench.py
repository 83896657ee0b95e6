"""MFU accounting (peaks, world size, never above 100%), bench.py's modes, batch_size='auto', and the
GPU battery (scripts/gpu_battery.py) at CPU scale and as planned for an H100."""

import gc
import json
import time

import numpy as np
import pytest
import torch
from conftest import CPU, TINY_BENCH, char_dataset, read_metrics, tiny_args, tiny_bench_args
from processes import REPO, load_script, run_script

import bench
from configurator import BenchConfig, TrainConfig
from gpt.data.batches import row_starts
from gpt.device import gpu_flops, runtime
from gpt.inference import sampling
from gpt.train import auto_batch, benchmark
from gpt.train.auto_batch import auto_batch_size, saved_activation_bytes, with_batch_size
from model import GPT, GPTConfig

battery = load_script("scripts/gpu_battery.py")

# names exactly as torch.cuda.get_device_name() reports them
DEVICE_PEAKS = [
    *((name, 989.4, 494.7) for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200")),
    ("NVIDIA H100 PCIe", 756.5, 378.0),
    *((name, 835.5, 417.5) for name in ("NVIDIA H100 NVL", "NVIDIA H200 NVL")),
    *((name, 312.0, 156.0) for name in ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe")),
    ("NVIDIA A10", 125.0, 62.5),
    ("NVIDIA L4", 121.0, 60.0),
    ("NVIDIA L40S", 362.1, 183.0),
    ("NVIDIA GeForce RTX 3090", 71.0, 35.6),
    ("NVIDIA GeForce RTX 4090", 165.2, 82.6),
    ("NVIDIA GeForce RTX 5090", 209.5, 104.8),
    ("NVIDIA GeForce RTX 3090 Ti", 80.0, 40.0),
    ("NVIDIA GeForce RTX 3060", 25.5, 12.7),
    ("NVIDIA GeForce RTX 3060 Ti", 32.4, 16.2),
    ("NVIDIA GeForce RTX 3070", 40.6, 20.3),
    ("NVIDIA GeForce RTX 3080", 59.5, 29.8),
    ("NVIDIA GeForce RTX 3080 Ti", 68.2, 34.1),
    ("NVIDIA GeForce RTX 4060", 30.2, 15.1),
    ("NVIDIA GeForce RTX 4070", 58.3, 29.1),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", 88.2, 44.1),
    ("NVIDIA GeForce RTX 4080", 97.5, 48.7),
    ("NVIDIA GeForce RTX 4080 SUPER", 104.4, 52.2),
    ("NVIDIA RTX A6000", 154.8, 77.4),
    ("NVIDIA RTX 6000 Ada Generation", 364.2, 182.1),
    ("NVIDIA A40", 149.7, 74.8),
    ("NVIDIA L40", 181.0, 90.5),
    ("NVIDIA B200", 2250.0, 1125.0),
    ("Tesla V100-SXM2-16GB", 125.0, 15.7),
    ("Tesla V100-PCIE-32GB", 112.0, 14.0),
    ("Tesla T4", 65.0, 8.1),
]


# unknown devices have no peak: no number is better than a wrong one (MFU shows n/a, and peak_flops= can supply it)
UNKNOWN = ["NVIDIA A10G", "NVIDIA GeForce RTX 3060 Laptop GPU", "AMD Instinct MI300X", "Tesla P100-PCIE-16GB"]


@pytest.mark.parametrize(
    "name, bf16, tf32", DEVICE_PEAKS + [(n, None, None) for n in UNKNOWN], ids=[d[0] for d in DEVICE_PEAKS] + UNKNOWN
)
def test_peak_lookup_by_reported_name(name, bf16, tf32):
    tera = lambda tflops: None if tflops is None else tflops * 1e12
    assert gpu_flops.peak_flops(name, torch.bfloat16) == tera(bf16)
    assert gpu_flops.peak_flops(name, torch.float16) == tera(bf16)
    assert gpu_flops.peak_flops(name, torch.float32) == tera(tf32)  # TF32 matmuls are on under CUDA


def test_peak_override_and_cpu():
    assert gpu_flops.device_peak_flops(CPU) is None
    assert gpu_flops.device_peak_flops(CPU, override=123e12) == 123e12


def test_mfu_scales_with_world_size():
    one = gpu_flops.mfu(1e15, 2.0, 989e12, world_size=1)
    assert one == pytest.approx(1e15 / 2.0 / 989e12)
    assert gpu_flops.mfu(1e15, 2.0, 989e12, world_size=8) == pytest.approx(one / 8)
    assert gpu_flops.mfu(1e15, 2.0, None) is None


def best_gemm_flops():
    """This CPU's best float32 matmul throughput: no training step can do better."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = 0.0
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * 1024**3 / (time.perf_counter() - start))
    return best


@pytest.fixture(scope="module")
def auto_batch_run(tmp_path_factory):
    """(train.py's result, its out_dir): batch_size='auto' within 50 MB, this CPU's best matmul as its peak."""
    root = tmp_path_factory.mktemp("auto_batch")
    keys = dict(batch_size="auto", total_batch_size=16 * 8, memory_budget_gb=0.05, peak_flops=best_gemm_flops())
    result = run_script("train.py", *tiny_args(char_dataset(root / "chars"), root / "out", max_iters=12, **keys))
    assert result.returncode == 0, result.stderr
    return result, root / "out"


def test_mfu_never_above_100_percent_in_training(auto_batch_run):
    mfus = [r["mfu"] for r in read_metrics(auto_batch_run[1]) if "mfu" in r]
    assert mfus[0] is None  # the first window holds warm-up
    assert all(0 < m <= 1 for m in mfus[1:]), mfus


@pytest.fixture(scope="module")
def profiled_bench(tmp_path_factory):
    """(bench.py's JSON line, its out_dir): 3 profiled steps; GPT-2's vocabulary, whose logits' matmul nears the peak."""
    out = tmp_path_factory.mktemp("bench")
    shape = dict(n_layer=2, n_embd=64, block_size=32, batch_size=8, gradient_accumulation_steps=2, bench_iters=2)
    profile = dict(profile=True, profile_wait=1, profile_warmup=1, profile_active=1, out_dir=out)
    result = run_script("bench.py", *tiny_bench_args(**shape, **profile, peak_flops=best_gemm_flops(), json=True))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), out


def test_bench_json_and_mfu_bound(profiled_bench):
    r = profiled_bench[0]
    assert {"ms_per_iter", "tokens_per_s", "tflops", "mfu", "peak_mem_mb"} <= r.keys()
    assert r["tokens_per_s"] == pytest.approx(2 * 8 * 32 / (r["ms_per_iter"] / 1000))
    assert r["tflops"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 1e12)
    assert 0 < r["mfu"] <= 1
    assert r["peak_mem_mb"] > 0


def test_sweep_keeps_tokens_per_step_and_marks_the_best(char_data):
    sweep = dict(batch_size=8, gradient_accumulation_steps=2, sweep="batch_size=2,4,16,3", json=True, dataset=char_data)
    result = run_script("bench.py", *tiny_bench_args(**sweep))  # char_data: 65 logits a token, not GPT-2's 50,257
    assert result.returncode == 0, result.stderr
    assert "skipping batch_size=3" in result.stdout  # 3 does not divide 16 sequences per step
    assert result.stdout.count("<- best") == 1
    r = json.loads(result.stdout.strip().splitlines()[-1])
    rows = r["rows"]
    assert [row["setting"] for row in rows] == ["batch_size=2", "batch_size=4", "batch_size=16"]
    assert {row["batch_size"] * row["gradient_accumulation_steps"] for row in rows} == {16}
    assert r["best"] == max(rows, key=lambda row: row["tokens_per_s"])["setting"]
    assert r["mfu"] is None and all(row["mfu"] is None for row in rows)  # no peak given, none on a CPU


def test_profile_writes_a_trace(profiled_bench):
    traces = list((profiled_bench[1] / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::mm" in e.get("name", "") for e in events)  # the matmuls of the step were recorded
    assert "ProfilerStep#" in traces[0].read_text()


def test_time_to_train_arithmetic():
    cfg = BenchConfig(estimate_params=1e9)
    rt = runtime.Runtime("cpu", "cpu", torch.float32, world_size=8)
    measured = {"params": 1e8, "flops_per_token": 6.5e8, "tflops": 400.0}
    est = bench.time_to_train(measured, cfg, rt)
    assert est["estimate_tokens"] == 20e9  # 20 tokens per parameter by default
    flops = 6.5 * 1e9 * 20e9  # FLOPs per token scaled with the parameters, times the tokens
    assert est["estimate_flops"] == pytest.approx(flops)
    assert est["estimate_hours"] == pytest.approx(flops / (400e12 * 8) / 3600)
    assert est["estimate_device_hours"] == pytest.approx(est["estimate_hours"] * 8)


def auto_cfg(**overrides):
    args = dict(batch_size="auto", block_size=32, total_batch_size=32 * 64, n_layer=2, n_head=2, n_embd=64)
    return TrainConfig(**{**args, **overrides})


def held_for_backward(model, rt, forward, skip=()):
    """Bytes autograd saves while forward() runs under rt's autocast, each storage once, less weights and `skip`."""
    seen = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *skip)}
    total = 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rt.autocast():
        forward()
    return total


def step_bytes(model, rt, batch, block_size=32):
    """What a training step at micro-batch `batch` holds beyond the weights, gradients and AdamW state: what its forward
    saves, and backward's logits gradient (float32 from the loss, and again for the padded rows)."""
    x = torch.zeros(batch, block_size, dtype=torch.long)
    logits_grad = 2 * batch * block_size * model.config.padded_vocab_size * 4
    return held_for_backward(model, rt, lambda: model(x, x)) + logits_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_batch_size_is_the_largest_that_fits_and_keeps_tokens_per_step(dtype):
    """bfloat16 autocast makes its weight copies on a CPU too: once a step, not once a sequence."""
    rt = runtime.Runtime("cpu", "cpu", dtype)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=65, bias=False))
    states = 16 * sum(p.numel() for p in model.parameters())  # fp32 weights, gradients, AdamW's two moments
    divisors = [d for d in range(1, 65) if 64 % d == 0]
    chosen = []
    for rows_fitting in (3, 10, 40, 200):
        budget = 0.85 * (states + step_bytes(model, rt, rows_fitting))  # what 85% of memory_budget_gb leaves
        b = auto_batch_size(model, auto_cfg(memory_budget_gb=budget / 0.85 / 2**30), rt)
        assert b in divisors  # divides the 64 sequences of a step
        assert states + step_bytes(model, rt, b) <= budget  # fits
        bigger = [d for d in divisors if d > b]
        assert not bigger or states + step_bytes(model, rt, bigger[0]) > budget  # and is the largest that does
        cfg = with_batch_size(auto_cfg(), b, 32 * 64)
        assert cfg.batch_size * cfg.gradient_accumulation_steps * cfg.block_size == 32 * 64
        chosen.append(b)
    assert chosen == sorted(chosen) and chosen[-1] == 64


def test_autocast_weight_copies_are_counted_once_per_step():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=65, bias=False))
    cfg = auto_cfg()
    per_row32, fixed32 = auto_batch.activation_bytes(model, cfg, CPU)
    per_row16, fixed16 = auto_batch.activation_bytes(model, cfg, runtime.Runtime("cpu", "cpu", torch.bfloat16))
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert fixed16 - fixed32 == 2 * linear_weights  # a bf16 copy of every matmul's weight (lm_head's too), once
    assert per_row16 < per_row32  # the activations themselves are half as wide


def test_activation_checkpointing_is_measured_as_training_runs_it():
    """Checkpointing keeps each block's input and what lies outside the blocks; backward then reruns
    one block at a time, which holds what it saves. Against that formula, one block measured alone."""
    rt = runtime.Runtime("cpu", "cpu", torch.bfloat16)
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=32, vocab_size=65, bias=False))
    plain, _ = auto_batch.activation_bytes(model, auto_cfg(), rt)
    checkpointed, _ = auto_batch.activation_bytes(model, auto_cfg(activation_checkpointing=True), rt)
    assert model.activation_checkpointing is False  # measured as asked, left as found

    def block_saved(batch):  # one block's forward, alone, as training runs it: what it saves besides its input
        x = torch.randn(batch, 32, 64, requires_grad=True)  # the input is among what checkpointing kept
        return held_for_backward(model, rt, lambda: model.transformer.h[0](x), skip=[x])

    model.activation_checkpointing = True
    x1, x2 = torch.zeros(1, 32, dtype=torch.long), torch.zeros(2, 32, dtype=torch.long)
    kept = held_for_backward(model, rt, lambda: model(x2, x2)) - held_for_backward(model, rt, lambda: model(x1, x1))
    model.activation_checkpointing = False
    logits_grad = 2 * 32 * model.config.padded_vocab_size * 4
    assert checkpointed == kept + (block_saved(2) - block_saved(1)) + logits_grad
    assert kept >= 4 * 32 * 64 * 4  # at least the four blocks' float32 inputs
    assert checkpointed < plain / 2
    gb = (16 * sum(p.numel() for p in model.parameters()) + 20 * plain) / 2**30
    with_checkpointing = auto_batch_size(model, auto_cfg(memory_budget_gb=gb, activation_checkpointing=True), rt)
    assert with_checkpointing > auto_batch_size(model, auto_cfg(memory_budget_gb=gb), rt)


def test_saved_activations_grow_linearly_with_context():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=65))
    short, long = saved_activation_bytes(model, 16, CPU), saved_activation_bytes(model, 64, CPU)
    assert 3.5 < long / short < 4.5


def test_train_with_auto_batch_size(auto_batch_run):
    result, out = auto_batch_run
    assert "batch_size=auto:" in result.stdout
    saved = json.loads((out / "config.json").read_text())  # what ran, not the word 'auto'
    assert isinstance(saved["batch_size"], int)
    assert saved["batch_size"] * saved["gradient_accumulation_steps"] * 16 == 16 * 8


@pytest.mark.process
def test_suite_runs_every_part_on_a_cpu_and_writes_its_reports(char_data, tmp_path):
    """The whole battery at its CPU scale, shortened: every part, report.md and report.json."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    char_data.rename(work / "data" / "shakespeare_char")  # the baby part trains on data/shakespeare_char
    shortened = ["--bench_iters=1", "--bench_warmup=1", "--baby_iters=4"]
    result = run_script("scripts/gpu_battery.py", "--device=cpu", f"--out_dir={work / 'report'}", *shortened, cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((work / "report" / "report.json").read_text())
    assert report["torch"] == torch.__version__ and report["device"].startswith("CPU")
    assert report["parts"] == ["env", "attention", "sweep", "llama", "baby", "smoke"]
    by_part = {}
    for row in report["rows"]:
        assert {"label", "ms_per_iter", "tokens_per_s", "tflops", "mfu", "peak_mem_mb"} <= set(row), row
        assert row["mfu"] is None and row["ms_per_iter"] > 0 and row["tokens_per_s"] > 0  # a CPU has no peak
        by_part.setdefault(row["part"], []).append(row)
    assert [r["label"] for r in by_part["attention"]] == ["attention=auto", "attention=flash", "attention=math"]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in report["attention"]["default_kernels"]
    assert report["attention"]["default_kind"] == ["flash"]  # the CPU's SDPA kernel, named
    assert len(report["attention"]["unavailable"]) == 2  # cudnn and efficient: CUDA only
    sweep = by_part["sweep"]
    assert len({r["batch_size"] * r["gradient_accumulation_steps"] for r in sweep}) == 1 and len(sweep) == 3
    assert [r["label"] for r in by_part["llama"]] == ["activation_checkpointing=False", "activation_checkpointing=True"]
    assert report["baby"]["iters"] == 4 and report["baby"]["final_val"] < 4.2  # below a uniform guess, ln(65)
    assert all(check["ok"] for check in report["smoke"].values()), report["smoke"]
    markdown = (work / "report" / "report.md").read_text()
    titles = ["Environment", "Attention", "GPT-2 sweep", "config/train_llama_tiny.py", "Baby GPT", "Correctness smoke"]
    for title in titles:
        assert f"## {title}" in markdown and f"## {title}" in result.stdout


def test_battery_parts_are_checked():
    with pytest.raises(Exception, match="parts: 'speed' not among env, attention"):
        battery.BatteryConfig(parts="env,speed")


# ---------------------------------------------------------------------------- the suite on an H100, planned on a CPU

# Each part's time on one H100, estimated from the plan the suite runs there (gpu_battery.suite_plan at
# the CUDA scale), for GPU machines that allow 10 minutes a command. Assumptions:
H100_PEAK, MFU = 989e12, 0.40  # bf16 dense peak; the model's FLOPs run at 40% of it
MIN_STEP_S, MIN_FORWARD_S = 0.036, 0.012  # small models run far below 40% MFU: nanoGPT's baby GPT took ~3 min
# for 5000 iterations on an A100 (36 ms an iteration, evals included); a forward pass is a third of a step
SETUP_S = 10  # each configuration: build the model, its optimizer and data, warm the allocator
PROCESS_S = 20  # each Python process a part starts (imports, CUDA context)
COMMAND_S = 30  # each gpu_battery.py command's own start-up


def h100_seconds(rows):
    total = 0.0
    for r in rows:
        tokens = r["steps"] * r["tokens_per_step"] + r["forward_passes"] * r["tokens_per_forward"] / 3
        flops = r["flops_per_token"] * tokens
        floor = r["steps"] * MIN_STEP_S + r["forward_passes"] * MIN_FORWARD_S
        total += max(flops / (MFU * H100_PEAK), floor) + SETUP_S + PROCESS_S * r["processes"]
        # torch.compile of a step: ~60 s for GPT-2 124M and smaller, ~90 s for the 1B
        total += (90 if r["params"] > 500e6 else 60) if r["compiled"] else 0
    return total


# the commands docs/benchmarking.md and gpu_battery.py's docstring give for running the suite on a GPU
SUITE_COMMANDS = ("env,attention,smoke", "sweep", "llama", "baby")


def test_every_suite_part_fits_8_minutes_on_an_h100_and_every_documented_command_10():
    """Printed with pytest -s: each part's estimate and each command's."""
    cuda = runtime.Runtime("cuda:0", "cuda", torch.bfloat16)
    # the defaults: python scripts/gpu_battery.py
    plan = battery.suite_plan(battery.BatteryConfig(), battery.suite_scale(cuda))
    assert list(plan) == list(battery.SUITE)
    assert sorted(",".join(SUITE_COMMANDS).split(",")) == sorted(battery.SUITE)  # every part, once
    llama = plan["llama"][0]
    assert llama["params"] == 1_235_814_400 and llama["tokens_per_step"] == 32_768  # the 1B's shapes, two micro-batches
    assert plan["baby"][0]["steps"] == 5000  # the baby config's own run: nanoGPT's 5000 iterations
    for part, rows in plan.items():
        seconds = h100_seconds(rows)
        print(f"suite part {part}: {seconds / 60:.1f} min on an H100 ({len(rows)} configuration(s))")
        assert seconds <= 8 * 60, part
    docs = (REPO / "docs" / "benchmarking.md").read_text() + battery.__doc__
    for command in SUITE_COMMANDS:
        seconds = COMMAND_S + sum(h100_seconds(plan[part]) for part in command.split(","))
        print(f"python scripts/gpu_battery.py --parts={command}: {seconds / 60:.1f} min")
        assert seconds <= 10 * 60, command
        assert f"--parts={command} " in docs, command


# ---------------------------------------------------------------------------- GPU-only paths of the suite, on a CPU

OOM_ERRORS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("CUDA error: out of memory"),
]


@pytest.mark.parametrize("error", OOM_ERRORS, ids=lambda e: str(e)[:40])
def test_every_kind_of_out_of_memory_is_a_row_that_did_not_fit(monkeypatch, error):
    calls = []
    monkeypatch.setattr(benchmark, "measure", lambda *args: (_ for _ in ()).throw(error))
    monkeypatch.setattr(gc, "collect", lambda: calls.append("gc.collect"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    cuda = runtime.Runtime("cuda:0", "cuda", torch.bfloat16)
    assert benchmark.measure_or_oom(BenchConfig(), cuda, None, 65) is None
    assert calls == ["gc.collect", "empty_cache"]  # the failed step's cycles first, then the cached blocks


def test_other_runtime_errors_still_stop_the_run(monkeypatch):
    error = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    monkeypatch.setattr(benchmark, "measure", lambda *args: (_ for _ in ()).throw(error))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        benchmark.measure_or_oom(BenchConfig(), CPU, None, 65)


def test_a_sweep_row_that_runs_out_of_cublas_memory_is_reported_not_raised(monkeypatch, capsys):
    """bench.py --sweep shares measure_or_oom with the GPU battery."""

    def measure(cfg, rt, data, vocab_size, profiler=None):
        if cfg.batch_size == 4:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        row = dict(ms_per_iter=10.0, tokens_per_s=1000.0, tflops=1.0, mfu=None, peak_mem_mb=1.0, warmup_s=1.0)
        return dict(row, batch_size=cfg.batch_size, gradient_accumulation_steps=cfg.gradient_accumulation_steps)

    monkeypatch.setattr(benchmark, "measure", measure)
    cfg = BenchConfig(**{**TINY_BENCH, "batch_size": 8, "sweep": "batch_size=2,4"})
    bench.run(cfg, CPU)
    out = capsys.readouterr().out
    assert "batch_size=4         out of memory" in out and "batch_size=2" in out and "<- best" in out


def test_the_baby_part_reads_an_unbuffered_train_py(monkeypatch, tmp_path):
    """Eval lines are timed as they arrive, so the child must not hold them in a pipe buffer."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "shakespeare_char").mkdir(parents=True)
    (tmp_path / "data" / "shakespeare_char" / "train.bin").write_bytes(b"")
    started = []

    def popen(args, **kwargs):
        started.append((args, kwargs))
        raise InterruptedError  # what it would run is all this test needs

    monkeypatch.setattr(battery.subprocess, "Popen", popen)
    cuda = runtime.Runtime("cuda:0", "cuda", torch.bfloat16)
    with pytest.raises(InterruptedError):
        battery.part_baby(battery.BatteryConfig(out_dir=str(tmp_path / "suite")), cuda, battery.suite_scale(cuda), {})
    ((args, kwargs),) = started
    unbuffered = args[1] == "-u" or kwargs.get("env", {}).get("PYTHONUNBUFFERED") == "1"
    assert args[0] == battery.sys.executable and unbuffered, args
    assert "--device=cuda:0" in args


def test_the_smoke_compares_cache_and_no_cache_with_tf32_off(monkeypatch, tmp_path):
    """TF32 (runtime.setup turns it on under CUDA) off for the float32 exactness check, then as it was."""
    seen = []
    generate = sampling.generate

    def recording_generate(model, *args, **kwargs):
        seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        return generate(model, *args, **kwargs)

    monkeypatch.setattr(sampling, "generate", recording_generate)
    monkeypatch.setattr(battery, "resume_check", lambda *args: {"ok": True})  # train.py subprocesses: tested above
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as setup() leaves a GPU
    try:  # (monkeypatch cannot put back cuBLAS's flag: its undo deletes it)
        report = {}
        battery.part_smoke(battery.BatteryConfig(out_dir=str(tmp_path)), CPU, battery.suite_scale(CPU), report)
        after = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert seen == [(False, False), (False, False)] and after == (True, True)
    assert report["smoke"]["kv_cache_greedy_equals_uncached"]["ok"]


# profiler event names from GPU runs (see gpu_battery.SDPA_KINDS for where each was seen)
KERNEL_KINDS = {  # kind: the names of its events
    "cudnn": [
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x1x1_kernel0_0",
        "cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
        "aten::_scaled_dot_product_cudnn_attention",
    ],
    "flash": [
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::half_t, "
        "Flash_kernel_traits<128, 128, 64, 4, cutlass::half_t> >, false, false, false, false, true, true, false, false>"
        "(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4, "
        "false, false, cutlass::bfloat16_t>>",
        "aten::_flash_attention_forward",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ],
    "efficient": [
        "fmha_cutlassF_f16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t, "
        "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
        "fmha_cutlassB_bf16_aligned_128x128_k128_sm80",
        "aten::_efficient_attention_forward",
    ],
    "math": ["aten::_scaled_dot_product_attention_math"],
    None: [
        "ampere_bf16_s1688gemm_bf16_128x128_ldg8_f2f_stages_32x1_tn",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>",
        "aten::scaled_dot_product_attention",  # the dispatcher, whichever kernel it picks
    ],
}
KERNEL_NAMES = [(name, kind) for kind, names in KERNEL_KINDS.items() for name in names]


@pytest.mark.parametrize("name, kind", KERNEL_NAMES, ids=[n[:50] for n, _ in KERNEL_NAMES])
def test_profiler_events_are_told_apart_by_kernel(name, kind):
    assert battery.sdpa_kernel_kind(name) == kind


@pytest.mark.parametrize(
    "keys", [dict(), dict(doc_mask=True), dict(batch_order="documents"), dict(batch_order="documents", doc_mask=True)]
)
def test_the_timed_steps_draw_batches_as_training_does(keys, monkeypatch, char_data):
    """The timed steps take rows that start at documents (batch_order) and give their document numbers (doc_mask)."""
    seen = []
    forward = GPT.forward

    def recording(self, idx, targets=None, **kwargs):
        seen.append((idx.detach().clone(), kwargs.get("docs")))
        return forward(self, idx, targets, **kwargs)

    monkeypatch.setattr(GPT, "forward", recording)
    cfg = BenchConfig(**{**TINY_BENCH, "block_size": 64, "batch_size": 4, "dataset": str(char_data), **keys})
    data, vocab = benchmark.bench_data(cfg)
    eot = vocab - 1
    assert benchmark.document_eot(cfg, vocab) == (eot if keys else None)
    benchmark.measure(cfg, CPU, data, vocab)
    assert len(seen) == 3
    starts = set(row_starts(data, eot, 64)[0].tolist())
    for idx, docs in seen:
        assert (docs is not None) == bool(keys.get("doc_mask"))
        if docs is not None:  # document numbers count the end-of-texts before each token in its row
            assert torch.equal(docs, torch.cumsum(idx == eot, dim=1))
        if keys.get("batch_order") == "documents":  # each row is one of the epoch's document rows (test_documents.py)
            windows = np.lib.stride_tricks.sliding_window_view(data, 16)
            for row in idx.numpy():
                at = np.flatnonzero((windows == row[:16]).all(axis=1))
                assert len(at) and set(at) <= starts, at
