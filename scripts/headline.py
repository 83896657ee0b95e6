"""The headline numbers in one command of at most 8 minutes on one GPU: GPT-2 124M's training step at
12 x 1024 and 32 x 1024 tokens, the speedrun recipe's at its own micro-batch (16 x 1024, accumulation
1, 8 and 32) beside plain GPT-2's at the same shapes, the 1B config's, the baby GPT trained to nanoGPT's
best val (the fast recipe, 2 seeds, each on a cold compile cache and on a warm one, and nanoGPT's own
config), and tests/test_gpu.py. With --nanogpt
(a checkout of github.com/karpathy/nanoGPT) its bench.py and its baby train.py run beside ours, the
baby runs interleaved, and the tables give each ratio. report.md and report.json go to out_dir,
rewritten after every step; each step's output to out_dir/logs/<step>.log.

    python data/shakespeare_char/prepare.py            # and nanoGPT's: cd ../nanoGPT && python data/shakespeare_char/prepare.py
    python scripts/headline.py --nanogpt=../nanoGPT --out_dir=headline
    python scripts/headline.py --nanogpt=../nanoGPT --parts=baby --baby_args="--compile=True" --baby_caches=warm
    python scripts/headline.py --device=cpu --out_dir=headline-cpu   # tiny shapes, a minute or two: the suite runs it

Each step is a process of its own with its own time limit, and the command stops at budget_s: a step
that hangs, or that the budget cuts short, is reported as such and the steps after it still run (or
are listed as not run, with the command that runs them), in this order: the speedrun recipe and
plain GPT-2, the baby GPT race, the 124M at 12 x 1024, tests/test_gpu.py, the 124M at 32 x 1024,
the 1B, nanoGPT's baby config trained by ours. On a CPU the same steps run at tiny shapes
(nanoGPT's bench.py needs CUDA: not run there).
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, REPO)
from configurator import parse, require, run_main
from gpt.device import runtime  # after the path line above

# the parts, in the order they run: what the issue asks first goes first, so a budget that runs out
# cuts the re-measurements of known numbers
PARTS = ("speedrun", "baby", "gpt2", "tests", "gpt2_32", "llama", "baby_config")
NANOGPT_BEST_H200 = 1.478  # nanoGPT's best val on an H200 (issue 47): the target when nanoGPT does not run here
START_MIN_S = 20  # a step starts only with at least this much of the budget left


def in_repo(path):
    """A config file named relative to the repository (as the docs name them), or a path of one's own."""
    return os.path.join(REPO, path) if os.path.isfile(os.path.join(REPO, path)) else path


@dataclass
class HeadlineConfig:
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    out_dir: str = "headline"  # report.md, report.json, logs/ and the baby runs' out_dirs (runs/)
    nanogpt: str = ""  # a checkout of github.com/karpathy/nanoGPT, its data/shakespeare_char prepared: its bench.py and train.py run beside ours
    device: str = "auto"  # 'auto' (cuda, else mps, else cpu), 'cuda', 'cpu': a GPU gets the real shapes, anything else tiny ones
    parts: str = ",".join(PARTS)  # the parts to run, comma-separated, among speedrun, baby, gpt2, tests, gpt2_32, llama, baby_config
    budget_s: float = 470.0  # the command's wall time from main(): no step runs past it; 0: no limit
    baby_seeds: int = 2  # baby GPT: runs a side (ours: seeds 1..N; nanoGPT fixes its seed, so its runs repeat 1337)
    baby_fast: str = "config/train_shakespeare_char_fast.py"  # baby GPT: our recipe raced against nanoGPT's train.py
    baby_args: str = ""  # baby GPT: more train.py flags for that recipe, e.g. '--compile=True'
    baby_caches: str = "cold,warm"  # baby GPT: 'cold' (each run an empty compile cache of its own), 'warm' (each run on a cache one untimed run of its side filled), or both
    # fmt: on

    def __post_init__(self):
        unknown = [p for p in self.parts.split(",") if p not in PARTS]
        require(not unknown, f"parts: {', '.join(map(repr, unknown))} not among {', '.join(PARTS)}")
        require(self.budget_s >= 0 and self.baby_seeds >= 1, "budget_s must be >= 0 and baby_seeds >= 1")
        require(os.path.isfile(in_repo(self.baby_fast)), f"baby_fast={self.baby_fast!r} is not a config file")
        caches = self.baby_caches.split(",")
        require(
            caches and set(caches) <= {"cold", "warm"} and len(set(caches)) == len(caches),
            f"baby_caches={self.baby_caches!r}: give 'cold', 'warm' or 'cold,warm'",
        )
        if self.nanogpt:
            require(
                all(os.path.isfile(os.path.join(self.nanogpt, f)) for f in ("bench.py", "train.py", "model.py")),
                f"nanogpt={self.nanogpt!r} is not a nanoGPT checkout (bench.py, train.py, model.py): "
                "git clone https://github.com/karpathy/nanoGPT",
            )
            data = os.path.join(self.nanogpt, "data", "shakespeare_char")
            require(
                "baby" not in self.parts or os.path.isfile(os.path.join(data, "meta.pkl")),
                f"{data} is not prepared: run python data/shakespeare_char/prepare.py in {self.nanogpt} "
                "(it reads input.txt there, else downloads it)",
            )


@dataclass
class Step:
    name: str  # the step's label in the report and its log's name
    part: str
    kind: str  # 'bench', 'nanogpt_bench', 'train', 'nanogpt_train', 'pytest'
    argv: list  # after the Python interpreter
    cwd: str
    limit_s: float
    meta: dict = field(default_factory=dict)  # what the report needs to read the result: tokens per step, seed, side
    env: dict = field(default_factory=dict)  # set in the process's environment: the baby runs' compile caches


def scale(device_type):
    """The steps' shapes: the real ones on a GPU, tiny ones elsewhere (the same code in seconds)."""
    if device_type == "cuda":
        return dict(
            name="GPT-2 124M",
            tiny=[],
            block=1024,
            gpt2_batches=(12, 32),
            speedrun_batch=16,
            accumulations=(1, 8, 32),  # 32: the speedrun config's own, on one GPU
            bench_iters=["--bench_iters=20", "--bench_warmup=10"],  # the issue's own command
            sweep_iters=["--bench_iters=10", "--bench_warmup=3"],
            llama=[
                "config/train_llama_1b.py",
                "--bench_iters=3",
                "--bench_warmup=1",
                "--gradient_accumulation_steps=2",
            ],
            llama_limit_s=240,  # a 16-layer graph to compile
            baby_tiny=[],
            baby_iters=2000,  # past nanoGPT's best (step 1,750 of 5,000); lr_decay_iters stays 5,000: the same schedule
            fast_iters=[],  # the recipe's own max_iters
            warmup_iters=[
                "--max_iters=20"
            ],  # a warm-up run: every graph of a run compiled (training, and eval at step 0)
        )
    tiny = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--compile=False", "--dtype=float32"]
    return dict(
        name="GPT-2 (2 layers x 64)",
        tiny=tiny,
        block=64,
        gpt2_batches=(2, 4),
        speedrun_batch=2,
        accumulations=(1, 2),
        bench_iters=["--bench_iters=1", "--bench_warmup=1"],
        sweep_iters=["--bench_iters=1", "--bench_warmup=1"],
        llama=["config/train_llama_tiny.py", "--compile=False", "--bench_iters=1", "--bench_warmup=1"],
        llama_limit_s=180,
        baby_tiny=tiny[:3]
        + ["--compile=False", "--batch_size=8", "--block_size=32", "--eval_interval=10", "--eval_iters=2"]
        + ["--warmup_iters=2", "--log_interval=5", "--lr_decay_iters=20"],
        baby_iters=20,
        fast_iters=["--max_iters=20"],
        warmup_iters=["--max_iters=4"],
    )


def bench_step(name, part, args, s, device, meta, limit_s=180):
    """bench.py with args (a config file named relative to the repository) on `device`."""
    args = [in_repo(a) if a.endswith(".py") else a for a in args]
    argv = [os.path.join(REPO, "bench.py"), *args, *s["tiny"], f"--device={device}", "--json=True"]
    return Step(name, part, "bench", argv, os.getcwd(), limit_s, meta)


def nanogpt_bench_step(cfg, name, part, batch, s):
    argv = [os.path.join(cfg.nanogpt, "bench.py"), "--real_data=False", f"--batch_size={batch}"]
    return Step(name, part, "nanogpt_bench", argv, cfg.nanogpt, 180, {"tokens": batch * s["block"]})


def gpt2_steps(cfg, device, s, batch, part):
    tokens = batch * s["block"]
    ours = [f"--batch_size={batch}", f"--block_size={s['block']}", "--gradient_accumulation_steps=1"]
    steps = [bench_step(f"gpt2-{batch}", part, ours + s["bench_iters"], s, device, {"tokens": tokens})]
    if cfg.nanogpt and device.startswith("cuda"):  # nanoGPT's bench.py synchronizes CUDA unconditionally
        steps.append(nanogpt_bench_step(cfg, f"nanogpt-gpt2-{batch}", part, batch, s))
    return steps


def speedrun_steps(device, s):
    """The speedrun config at its own micro-batch and plain GPT-2 at the same shapes, each over the
    accumulations in one bench.py sweep (the second row's compile finds the first's kernels in
    inductor's cache)."""
    shape = [f"--batch_size={s['speedrun_batch']}", f"--block_size={s['block']}"]
    sweep = ["--sweep=gradient_accumulation_steps=" + ",".join(map(str, s["accumulations"])), *s["sweep_iters"]]
    meta = {"tokens": s["speedrun_batch"] * s["block"]}
    return [
        bench_step("speedrun", "speedrun", ["config/speedrun_gpt2.py", *shape, *sweep], s, device, meta, 240),
        bench_step("plain", "speedrun", [*shape, *sweep], s, device, meta, 240),
    ]


def cache_env(path):
    """A compile cache of its own at path: inductor's (FX graphs, AOTAutograd, kernels) and Triton's."""
    return {"TORCHINDUCTOR_CACHE_DIR": path, "TRITON_CACHE_DIR": os.path.join(path, "triton")}


def baby_steps(cfg, device, s):
    """nanoGPT's train.py and our fast recipe, interleaved run by run, for each of cfg.baby_caches:
    cold, every run on an empty compile cache of its own (a first run on a new machine); warm, every
    run on its side's cache, filled first by one untimed run (a user's second run)."""
    out = os.path.abspath(cfg.out_dir)
    sides = ["nanogpt"] * bool(cfg.nanogpt) + ["fast"]

    def run(side, seed, cache, iters, kind=None, name=None):
        name = name or f"baby-{cache}-{side}-{seed}"
        meta = {"side": side, "seed": seed, "cache": cache}
        out_dir = f"--out_dir={os.path.join(out, 'runs', name)}"
        if side == "nanogpt":
            argv = ["train.py", "config/train_shakespeare_char.py", *iters, *s["baby_tiny"], f"--device={device}"]
            cwd, kind, limit = cfg.nanogpt, kind or "nanogpt_train", 150
        else:
            argv = [os.path.join(REPO, "train.py"), in_repo(cfg.baby_fast), *s["baby_tiny"], *iters]
            argv += [*cfg.baby_args.split(), f"--seed={seed}", f"--device={device}", "--overwrite=True"]
            cwd, kind, limit = os.getcwd(), kind or "train", 120
        path = os.path.join(out, "caches", name if cache == "cold" else f"warm-{side}")
        return Step(name, "baby", kind, [*argv, out_dir], cwd, limit, meta, cache_env(path))

    steps = []
    for cache in cfg.baby_caches.split(","):
        if cache == "warm":
            steps += [run(side, 1, cache, s["warmup_iters"], "warmup", f"baby-warmup-{side}") for side in sides]
        for seed in range(1, cfg.baby_seeds + 1):
            steps += [
                run(side, seed, cache, [f"--max_iters={s['baby_iters']}"] if side == "nanogpt" else s["fast_iters"])
                for side in sides
            ]
    return steps


def baby_config_step(cfg, device, s):
    """Ours on nanoGPT's own baby config, one seed, cut where nanoGPT's runs are."""
    argv = [os.path.join(REPO, "train.py"), os.path.join(REPO, "config/train_shakespeare_char.py")]
    argv += [f"--max_iters={s['baby_iters']}", *s["baby_tiny"], "--seed=1", f"--device={device}", "--overwrite=True"]
    argv += [f"--out_dir={os.path.join(os.path.abspath(cfg.out_dir), 'runs', 'config-1')}"]
    return Step("baby-config-1", "baby_config", "train", argv, os.getcwd(), 150, {"side": "config", "seed": 1})


def plan(cfg, device):
    """Every step the command runs, in order, for cfg.parts on `device`."""
    s = scale(device.split(":")[0])
    tests = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    by_part = {
        "speedrun": lambda: speedrun_steps(device, s),
        "baby": lambda: baby_steps(cfg, device, s),
        "gpt2": lambda: gpt2_steps(cfg, device, s, s["gpt2_batches"][0], "gpt2"),
        "tests": lambda: [Step("tests", "tests", "pytest", tests, REPO, 180)],
        "gpt2_32": lambda: gpt2_steps(cfg, device, s, s["gpt2_batches"][1], "gpt2_32"),
        "llama": lambda: [bench_step("llama", "llama", s["llama"], s, device, {}, s["llama_limit_s"])],
        "baby_config": lambda: [baby_config_step(cfg, device, s)],
    }
    wanted = cfg.parts.split(",")
    return [step for part in PARTS if part in wanted for step in by_part[part]()]


def run_process(argv, cwd, limit_s, log_path, extra_env=None):
    """Run `python argv` in cwd, extra_env added to its environment (unbuffered: each line is timed as it is printed) for at most
    limit_s seconds, its whole process group killed at the limit. -> (status, seconds, [(t, line)]),
    status 'ok', 'failed' (non-zero exit) or 'timeout'; t counts from the launch."""
    lines, start = [], time.perf_counter()
    env = {**os.environ, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: compile workers and all go at the limit
    )
    reader = threading.Thread(
        target=lambda: lines.extend((time.perf_counter() - start, line) for line in proc.stdout), daemon=True
    )
    reader.start()
    try:
        proc.wait(timeout=limit_s)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = "timeout"
    reader.join(timeout=30)
    seconds = time.perf_counter() - start
    with open(log_path, "w") as f:
        assigned = "".join(f"{k}={v} " for k, v in (extra_env or {}).items())
        f.write(f"$ cd {cwd} && {assigned}{sys.executable} {' '.join(argv)}\n# {status} after {seconds:.1f} s\n")
        f.writelines(line for _, line in lines)
    return status, seconds, lines


# what the commands print: bench.py's --json=True last line; nanoGPT's bench.py "time per iteration:
# 26.0412ms, MFU: 40.12%"; an eval of either train.py "step 250: train loss 1.9697, val loss 2.0675";
# a logged step, ours "iter 10: loss ..., 12.3 ms/iter, ..." and nanoGPT's "iter 10: loss 2.5, time 12.34ms, mfu 3.10%";
# pytest's summary "3 passed, 9 skipped in 4.19s"
NANOGPT_BENCH = re.compile(r"time per iteration: ([\d.]+)ms")
EVAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")
ITER_MS = re.compile(r"^iter \d+: .*?(?:([\d.]+) ms/iter|time ([\d.]+)ms)")
PYTEST = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def read_result(step, lines):
    """The numbers a finished step printed, as the report keeps them."""
    text = [line for _, line in lines]
    if step.kind == "bench":
        last = next((line for line in reversed(text) if line.startswith("{")), None)
        result = json.loads(last) if last else {}
        return {"rows": result.get("rows") or ([{"setting": "", **result}] if result else [])}
    if step.kind == "nanogpt_bench":
        m = next((NANOGPT_BENCH.search(line) for line in text if NANOGPT_BENCH.search(line)), None)
        if not m:
            return {}
        ms = float(m[1])
        return {"rows": [{"setting": "", "ms_per_iter": ms, "tokens_per_s": step.meta["tokens"] / ms * 1000}]}
    if step.kind == "warmup":
        return {}
    if step.kind in ("train", "nanogpt_train"):
        evals = [(int(m[1]), float(m[2]), round(t, 2)) for t, line in lines if (m := EVAL.match(line))]
        ms = [float(m[1] or m[2]) for _, line in lines if (m := ITER_MS.match(line))][1:]  # past the first: compilation
        return {"evals": evals, "ms_per_iter": statistics.median(ms) if ms else None}
    counts = {}
    for line in text[-5:]:
        for n, what in PYTEST.findall(line):
            counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
    return {"counts": counts}


def environment(device):
    env = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0]}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = None
    return env


def run_all(cfg, steps, write, start):
    """Every step in order under its limit and what is left of budget_s since `start` (a
    perf_counter time); `write` after each. -> the report's list of steps."""
    os.makedirs(os.path.join(cfg.out_dir, "logs"), exist_ok=True)
    done = []
    for step in steps:
        left = cfg.budget_s - (time.perf_counter() - start) if cfg.budget_s else float("inf")
        record = {"name": step.name, "part": step.part, "kind": step.kind, "command": step.argv, "cwd": step.cwd}
        record["meta"] = step.meta
        if left < START_MIN_S:
            done.append({**record, "status": "not run: budget", "seconds": 0.0})
            continue
        log = os.path.join(cfg.out_dir, "logs", f"{step.name}.log")
        status, seconds, lines = run_process(step.argv, step.cwd, min(step.limit_s, left), log, step.env)
        if status == "timeout" and left < step.limit_s:
            status = "stopped: budget"
        done.append({**record, "status": status, "seconds": round(seconds, 1), **read_result(step, lines)})
        print(f"{step.name}: {status} in {seconds:.1f} s", flush=True)
        write(done)
    return done


def bench_rows(steps):
    """{(step name, setting): row} of every timed configuration."""
    return {(s["name"], r.get("setting", "")): r for s in steps for r in s.get("rows", [])}


def step_table(steps, s):
    """The training steps, ours beside nanoGPT's where it ran: [(label, ours row, nanoGPT row)]."""
    rows = bench_rows(steps)
    out = []
    for batch in s["gpt2_batches"]:
        label = f"{s['name']}, {batch} x {s['block']}, accumulation 1"
        out.append((label, rows.get((f"gpt2-{batch}", "")), rows.get((f"nanogpt-gpt2-{batch}", ""))))
    for name, what in (("plain", s["name"]), ("speedrun", "config/speedrun_gpt2.py")):
        for accum in s["accumulations"]:
            row = rows.get((name, f"gradient_accumulation_steps={accum}"))
            out.append((f"{what}, {s['speedrun_batch']} x {s['block']}, accumulation {accum}", row, None))
    out.append((f"{s['llama'][0]}", rows.get(("llama", "")), None))
    return out


def speedrun_ratios(steps, s):
    """[(accumulation, speedrun tokens/s, plain tokens/s, ratio)] where both ran; the goal is
    >= 0.9 and >= 450K tokens/s on the GPU."""
    rows = bench_rows(steps)
    out = []
    for accum in s["accumulations"]:
        key = f"gradient_accumulation_steps={accum}"
        fast, plain = rows.get(("speedrun", key)), rows.get(("plain", key))
        if fast and plain and "tokens_per_s" in fast and "tokens_per_s" in plain:
            out.append(
                (accum, fast["tokens_per_s"], plain["tokens_per_s"], fast["tokens_per_s"] / plain["tokens_per_s"])
            )
    return out


def first_at_or_below(evals, target):
    """(step, seconds) of the first eval with val <= target, or None."""
    return next(((step, t) for step, val, t in evals if val <= target), None)


def baby_summary(steps):
    """The race, for each compile cache the runs had ('cold', 'warm'): the target is nanoGPT's best
    val (the median of its runs' bests, cold and warm, in this command; without nanoGPT,
    NANOGPT_BEST_H200); nanoGPT's time is each run's time to its own best, ours each run's time to
    its first eval at or under the target. Times are from the process's launch: start-up and
    compilation included. The ratio is the fast recipe's median over nanoGPT's, cache against cache."""
    runs = [s for s in steps if s["kind"] in ("train", "nanogpt_train") and s.get("evals")]
    nano = [s for s in runs if s["meta"]["side"] == "nanogpt"]
    best = lambda s: min(s["evals"], key=lambda e: e[1])  # (step, val, seconds)
    target = statistics.median(best(s)[1] for s in nano) if nano else NANOGPT_BEST_H200
    rows = []
    for s in runs:
        hit = first_at_or_below(s["evals"], target)
        counted = best(s)[2] if s in nano else (hit[1] if hit else None)
        rows.append(
            dict(name=s["name"], side=s["meta"]["side"], cache=s["meta"].get("cache"), best=best(s), at_target=hit)
            | dict(seconds_counted=counted, first_eval_s=s["evals"][0][2], ms_per_iter=s["ms_per_iter"])
            | dict(wall_s=s["seconds"])
        )
    races = {}
    for cache in dict.fromkeys(r["cache"] for r in rows if r["side"] != "config"):
        nano_s = median_or_none([r["seconds_counted"] for r in rows if (r["side"], r["cache"]) == ("nanogpt", cache)])
        fast_s = median_or_none([r["seconds_counted"] for r in rows if (r["side"], r["cache"]) == ("fast", cache)])
        ratio = fast_s / nano_s if nano_s and fast_s is not None else None
        races[cache] = dict(nanogpt_s=nano_s, fast_s=fast_s, ratio=ratio)
    from_ = "nanoGPT's runs here" if nano else "nanoGPT on an H200 (issue 47)"
    return dict(target=target, target_from=from_, runs=rows, races=races)


def median_or_none(values):
    """The median, a run that never got there counting as infinitely slow; None for no runs."""
    if not values:
        return None
    m = statistics.median(float("inf") if v is None else v for v in values)
    return None if m == float("inf") else m


def fmt(v, spec=".4g"):
    return "n/a" if v is None else format(v, spec)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def markdown(cfg, env, steps, s):
    """report.md: the tables, from the steps run so far."""
    out = [f"# scripts/headline.py: {env['gpu'] or 'CPU'}, torch {env['torch']}\n"]
    rows = []
    for label, ours, nano in step_table(steps, s):
        ratio = ours["tokens_per_s"] / nano["tokens_per_s"] if ours and nano and "tokens_per_s" in ours else None
        mfu = ours.get("mfu") if ours else None
        rows.append(
            [label, fmt(ours and ours.get("ms_per_iter"), ".1f"), fmt(ours and ours.get("tokens_per_s"), ",.0f")]
            + [fmt(mfu, ".1%"), fmt(nano and nano["ms_per_iter"], ".1f"), fmt(nano and nano["tokens_per_s"], ",.0f")]
            + [fmt(ratio, ".3f")]
        )
    header = ["", "ms/iter", "tokens/s", "MFU", "nanoGPT ms/iter", "nanoGPT tokens/s", "ours / nanoGPT"]
    out.append("## Training step (bench.py; nanoGPT's bench.py --real_data=False)\n\n" + table(header, rows))
    ratios = [[a, f"{f:,.0f}", f"{p:,.0f}", f"{r:.3f}"] for a, f, p, r in speedrun_ratios(steps, s)]
    out.append(
        "## The speedrun recipe against plain GPT-2, equal shapes (goal: >= 0.9x and >= 450K tokens/s)\n\n"
        + table(["accumulation", "speedrun tokens/s", "plain tokens/s", "speedrun / plain"], ratios)
    )
    baby = baby_summary(steps)
    rows = [
        [r["name"], f"{r['best'][1]:.4f} (step {r['best'][0]}, {r['best'][2]:.1f} s)"]
        + [f"step {r['at_target'][0]}, {r['at_target'][1]:.1f} s" if r["at_target"] else "not reached"]
        + [
            fmt(r["seconds_counted"], ".1f"),
            f"{r['first_eval_s']:.1f}",
            fmt(r["ms_per_iter"], ".1f"),
            f"{r['wall_s']:.1f}",
        ]
        for r in baby["runs"]
    ]
    header = ["run", "best val", "first eval <= target", "seconds counted", "first eval (s)", "ms/iter", "wall (s)"]
    races = [
        f"{cache} cache: nanoGPT (time to its best) {fmt(r['nanogpt_s'], '.1f')} s; ours, the fast recipe (time to "
        f"the target) {fmt(r['fast_s'], '.1f')} s; ratio {fmt(r['ratio'], '.3f')} (goal: <= 0.5).\n"
        for cache, r in baby["races"].items()
        if cache is not None
    ]
    out.append(
        f"## Baby GPT to val {baby['target']:.4f} ({baby['target_from']})\n\n"
        + table(header, rows)
        + "\n"
        + "".join(races)
        + "Medians over runs; times from each process's launch, compilation included.\n"
    )
    tests = next((t for t in steps if t["kind"] == "pytest"), None)
    if tests:
        counts = ", ".join(f"{n} {what}" for what, n in tests.get("counts", {}).items()) or "no summary"
        out.append(f"## tests/test_gpu.py\n\n{tests['status']}: {counts}\n")
    rows = [[t["name"], t["status"], t["seconds"], f"logs/{t['name']}.log" if t["seconds"] else ""] for t in steps]
    out.append("## Steps\n\n" + table(["step", "status", "seconds", "output"], rows))
    cut = [p for p in PARTS if any(t["part"] == p and t["status"].endswith("budget") for t in steps)]
    if cut:
        again = [f"--parts={','.join(cut)}", f"--out_dir={cfg.out_dir}-2"]
        again += [f"--nanogpt={cfg.nanogpt}"] * bool(cfg.nanogpt) + [f"--baby_args={cfg.baby_args!r}"] * bool(
            cfg.baby_args
        )
        out.append(f"The budget cut parts {', '.join(cut)}: `python scripts/headline.py {' '.join(again)}`\n")
    return "\n".join(out)


def main(argv=None):
    start = time.perf_counter()
    cfg = parse(HeadlineConfig, argv)
    device = runtime.pick_device(cfg.device)
    s = scale(device.split(":")[0])
    env = environment(device)
    os.makedirs(cfg.out_dir, exist_ok=True)

    def write(steps):
        report = {**env, "budget_s": cfg.budget_s, "nanogpt": cfg.nanogpt or None, "steps": steps}
        report["baby"] = baby_summary(steps)
        report["speedrun_over_plain"] = speedrun_ratios(steps, s)
        with open(os.path.join(cfg.out_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(cfg.out_dir, "report.md"), "w") as f:
            f.write(markdown(cfg, env, steps, s))

    steps = run_all(cfg, plan(cfg, device), write, start)
    write(steps)
    print(markdown(cfg, env, steps, s))
    print(f"wrote {cfg.out_dir}/report.md and report.json")
    return 1 if any(t["status"] in ("failed", "timeout") for t in steps) else 0  # the budget's cuts are planned


if __name__ == "__main__":
    run_main(main)
