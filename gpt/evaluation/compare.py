"""Is B better than A? bench.py --against=... trains two configurations with several seeds each,
scores every run's final checkpoint on the same val tokens, and tests the difference.

    python bench.py config/train_shakespeare_char_cpu.py --max_iters=500 --against="--mlp=swiglu" --seeds=5
    python bench.py config/train_shakespeare_char_cpu.py --compare="--optimizer=adamw" --against="--optimizer=muon" \\
        --seeds=5 --target=1.9

A side is train.py's arguments: bench.py's own config files and train.py keys, then the side's
(`compare` for A, `against` for B; the side's flags win). Each run is a process of its own,
`python train.py <side> --seed=S --out_dir=<compare_dir>/<A|B>-s<S> --overwrite=True`: its wall time
includes start-up, as a user's does, and nothing (allocator, compile caches, RNG) carries from one
run to the next. A takes seeds 1..N and B the next N (side_seeds): independent samples. Runs go
A, B, A, B, ..., so a machine that speeds up or slows down meanwhile favours neither side. The loss compared is eval.py's split_loss on each run's final
checkpoint: the first compare_eval_tokens of val (0: all of it), the same tokens for every run. The
loop's own evals (windows drawn with the run's seed) give only the curves and the time to target.
"""

import dataclasses
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch

from configurator import TrainConfig, UserError, parse
from gpt.data import token_files, tokenizer
from gpt.evaluation import tasks
from gpt.weights import load

SIDES = ("A", "B")
TRAIN_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "train.py")
STOPPED = 75  # train.py's exit code for a run stopped with a checkpoint (its EXIT_STOPPED): max_minutes ended it
MIN_SEEDS = 3  # fewer runs per side: a t-test's variance estimate is too poor to tell anything
ALPHA = 0.05


def seed_list(seeds):
    """--seeds: N -> [1, ..., N]; a list is the seeds themselves (validated distinct by BenchConfig)."""
    return list(range(1, seeds + 1)) if isinstance(seeds, int) else list(seeds)


def side_seeds(seeds):
    """{'A': the seeds, 'B': as many after A's largest}. No run of B shares a seed with one of A:
    the sides are independent samples, as Welch's test assumes. With shared seeds two identical
    configurations would agree run for run, and p = 1 would say nothing about the test."""
    return {"A": seeds, "B": [s + max(seeds) for s in seeds]}


def train_keys(argv):
    """bench.py's arguments that train.py takes: config files and train.py's keys (bench.py's own
    keys, the comparison's among them, stay here)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return [a for a in argv if not a.startswith("-") or a.lstrip("-").partition("=")[0] in names]


def run_flags(seed, out_dir):
    # last on the command line, so they win over the side's own
    return [f"--seed={seed}", f"--out_dir={out_dir}", "--overwrite=True"]


def side_args(base, spec, name, key, compare_dir):
    """(train.py's arguments for a side, its TrainConfig), validated now so that a mistake in B
    stops the comparison before A's first run."""
    try:
        args = [*base, *shlex.split(spec)]
    except ValueError as e:
        raise UserError(f"--{key}={spec!r} cannot be split into arguments ({e}); quote it as a shell would")
    try:
        cfg = parse(TrainConfig, [*args, *run_flags(1, os.path.join(compare_dir, f"{name}-s1"))])
    except UserError as e:
        raise UserError(f"side {name} (--{key}): {e}")
    return args, cfg


def run_train(args, log_path):
    """train.py with `args` in a fresh Python process, its output in log_path; its exit code."""
    with open(log_path, "w") as log:
        return subprocess.run([sys.executable, TRAIN_PY, *args], stdout=log, stderr=subprocess.STDOUT).returncode


def last_line(path):
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "(no output)"


def read_records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_seconds(steps, until):
    """The loop's training time before iteration `until`: each logged step's ms/iter times the
    iterations its window covered. Evals, checkpoints and start-up are not in it."""
    total, previous = 0.0, -1
    for r in steps:
        if r["iter"] >= until:
            break
        total += r["dt_ms"] / 1000 * (r["iter"] - previous)
        previous = r["iter"]
    return total


def curve_numbers(records, target):
    """From a run's metrics.jsonl: its median ms/iter (the first window, start-up and compilation,
    left out) and, with a target, the first loop eval at or below it: its iteration and the
    training time to it (None when never reached)."""
    steps = [r for r in records if "loss" in r and "dt_ms" in r]
    evals = [r for r in records if r.get("val_loss") is not None]
    timed = steps[1:] or steps
    out = {
        "ms_per_iter": statistics.median(r["dt_ms"] for r in timed) if timed else None,
        "loop_evals": [[r["iter"], r["val_loss"]] for r in evals],
    }
    if target:
        reached = next((r["iter"] for r in evals if r["val_loss"] <= target), None)
        out["target_iter"] = reached
        out["target_train_s"] = None if reached is None else train_seconds(steps, reached)
    return out


def score(out_dir, dataset, rt, max_tokens):
    """split_loss of the run's final checkpoint on the first max_tokens (0: all) of val."""
    model, tok_spec = load.for_inference("resume", out_dir, "latest", report=lambda message: None)
    model.to(rt.device)
    data = token_files.Tokens.open(os.path.join("data", dataset), "val")
    scored = tasks.split_loss(
        model, data, model.config.block_size, rt, tokenizer.token_bytes(tok_spec), max_tokens=max_tokens
    )
    del model
    if rt.device_type == "cuda":
        torch.cuda.empty_cache()  # the GPU memory this process cached goes back to the next run's train.py
    return scored


def one_run(side, seed, args, side_cfg, cfg, rt):
    """Train one side with one seed and score its final checkpoint: the run's numbers, and its
    metrics records for the plot. A run max_minutes stopped is finished: a time budget is a fair race."""
    out_dir = os.path.join(cfg.compare_dir, f"{side}-s{seed}")
    log = out_dir + ".log"
    start = time.perf_counter()
    code = run_train([*args, *run_flags(seed, out_dir)], log)
    wall = time.perf_counter() - start
    if code != 0 and not (code == STOPPED and side_cfg.max_minutes):
        raise UserError(
            f"side {side}, seed {seed}: train.py exited with {code} ({last_line(log)}); its output is in {log}"
        )
    scored = score(out_dir, side_cfg.dataset, rt, cfg.compare_eval_tokens)
    records = read_records(out_dir)
    run = {
        "side": side,
        "seed": seed,
        "out_dir": out_dir,
        "val_loss": scored["loss"],
        "val_bpb": scored["bpb"],
        "val_tokens": scored["tokens"],
        "wall_s": wall,
        **curve_numbers(records, cfg.target),
    }
    return run, records


# ---------------------------------------------------------------------------- statistics


def interval(values):
    """{n, mean, low, high}: the mean and its 95% t interval (n - 1 degrees of freedom, the
    standard error of the mean); no interval from one value."""
    from scipy import stats  # imported when a comparison asks, not with bench.py

    n, mean = len(values), sum(values) / len(values) if values else math.nan
    low = high = None
    if n >= 2:
        sem = stats.sem(values)
        low, high = (mean, mean) if sem == 0 else map(float, stats.t.interval(0.95, n - 1, loc=mean, scale=sem))
    return {"n": n, "mean": mean, "low": low, "high": high}


def welch(a, b):
    """B - A: the difference of the means, Welch's 95% interval and two-sided p-value (unequal
    variances); no interval or p from fewer than MIN_SEEDS values a side, or from no variation."""
    from scipy import stats

    out = {"diff": sum(b) / len(b) - sum(a) / len(a) if a and b else None, "low": None, "high": None, "p": None}
    if min(len(a), len(b)) >= MIN_SEEDS and (statistics.pvariance(a) > 0 or statistics.pvariance(b) > 0):
        result = stats.ttest_ind(b, a, equal_var=False)
        ci = result.confidence_interval(0.95)
        out.update(low=float(ci.low), high=float(ci.high), p=float(result.pvalue))
    return out


def check_seeds_matter(runs):
    """Runs of one side that all end at the same loss to the last bit are one run repeated: the
    seed did not reach the training, and a p-value from them would be a lie."""
    for side in SIDES:
        losses = [r["val_loss"] for r in runs if r["side"] == side]
        if len(losses) >= 2 and len(set(losses)) == 1:
            raise UserError(
                f"side {side}'s {len(losses)} runs all ended at val loss {losses[0]!r}, to the last bit: the seed does "
                f"not change its training (is it pinned?), so there is no sample to test"
            )


def summarize(runs, target):
    """Per quantity: each side's interval and B - A (Welch). Time to target: the runs that reached
    it; a p-value only when every run of both sides did."""
    by = lambda key, side: [r[key] for r in runs if r["side"] == side and r.get(key) is not None]
    summary = {}
    for key in ("val_loss", "wall_s") + (("target_iter", "target_train_s") if target else ()):
        a, b = by(key, "A"), by(key, "B")
        all_reached = all(r.get(key) is not None for r in runs)
        summary[key] = {"A": interval(a), "B": interval(b), "B-A": welch(a, b) if all_reached else welch([], [])}
    ms_a, ms_b = (statistics.median(by("ms_per_iter", side)) if by("ms_per_iter", side) else None for side in SIDES)
    summary["ms_per_iter"] = {"A": ms_a, "B": ms_b, "B/A": ms_b / ms_a if ms_a and ms_b else None}
    return summary


# ---------------------------------------------------------------------------- the report


ROWS = {
    "val_loss": "final val loss",
    "wall_s": "wall time per run (s)",
    "target_iter": "iterations to val loss <= {target}",
    "target_train_s": "training time to val loss <= {target} (s)",
}


def fmt(x, digits):
    return f"{x:.{digits}f}"


def cell(s, digits):
    if s["n"] == 0:
        return "none reached"
    if s["low"] is None:
        return fmt(s["mean"], digits)
    return f"{fmt(s['mean'], digits)} [{fmt(s['low'], digits)}, {fmt(s['high'], digits)}]"


def cell_ms(ms):
    return "no steps logged" if ms is None else f"{ms:.1f}"


def diff_cell(d, digits):
    if d["diff"] is None:
        return "n/a"
    interval_text = f" [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]" if d["low"] is not None else ""
    return f"{d['diff']:+.{digits}f}{interval_text}"


def verdict(d, n):
    """One honest sentence on the val loss difference."""
    if n < MIN_SEEDS:
        return f"{n} seed(s) per side is too few to tell anything: no p-value (run --seeds={MIN_SEEDS} or more)"
    if d["p"] < ALPHA:
        return f"B's val loss is {'higher' if d['diff'] > 0 else 'lower'} than A's (p = {d['p']:.3g}, Welch's t-test)"
    return (
        f"no significant difference at {ALPHA} (p = {d['p']:.3g}, Welch's t-test): not evidence that the two are "
        f"equal; more seeds narrow the interval"
    )


def table(result):
    s, target = result["summary"], result["target"]
    n = len(result["seeds"]["A"])
    reached = lambda side: sum(r.get("target_iter") is not None for r in result["runs"] if r["side"] == side)
    extra = lambda key: f"`{result[key]}`" if result[key] else "nothing more"
    tokens_scored = " and ".join(sorted({f"{r['val_tokens']:,}" for r in result["runs"]}))
    lines = [
        f"- both sides: `python train.py {shlex.join(result['common'])}`",
        f"- A: {extra('compare')}",
        f"- B: {extra('against')}",
        f"- seeds: A {', '.join(map(str, result['seeds']['A']))}; B {', '.join(map(str, result['seeds']['B']))} "
        f"(independent samples); runs interleaved A, B, A, B, ...",
        f"- val loss: each run's final checkpoint on the same {tokens_scored} val tokens "
        f"({'all of val' if not result['compare_eval_tokens'] else 'compare_eval_tokens from its start'})",
        "- cells: mean [95% t interval]; B - A [Welch's 95% interval]; p: Welch's t-test (unequal variances)",
        "",
        "| | A | B | B - A | p |",
        "|---|---|---|---|---|",
    ]
    digits = {"val_loss": 4, "wall_s": 1, "target_iter": 0, "target_train_s": 1}
    for key in [k for k in ROWS if k in s]:
        name = ROWS[key].format(target=target)
        d = s[key]["B-A"]
        a, b = cell(s[key]["A"], digits[key]), cell(s[key]["B"], digits[key])
        if key.startswith("target"):
            a, b = f"{a} ({reached('A')}/{n})", f"{b} ({reached('B')}/{n})"
        p = "n/a" if d["p"] is None else f"{d['p']:.3g}"
        lines.append(f"| {name} | {a} | {b} | {diff_cell(d, digits[key])} | {p} |")
    ms = s["ms_per_iter"]
    ratio = "n/a" if ms["B/A"] is None else f"B/A {ms['B/A']:.3f}"
    lines.append(f"| ms/iter (median of the runs' medians) | {cell_ms(ms['A'])} | {cell_ms(ms['B'])} | {ratio} | |")
    lines += ["", verdict(s["val_loss"]["B-A"], n)]
    if target:
        lines.append(
            f"time to target: from the loop's own evals (every eval_interval, on its eval windows); (k/{n}): the runs "
            "that reached it; training time: the loop's step times summed, evals and start-up left out"
        )
    return "\n".join(lines)


def plot(result, records, path):
    """The loss curves, one colour per side: the mean over seeds, the band from min to max."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, side in enumerate(SIDES):
        mine = [records[j] for j, r in enumerate(result["runs"]) if r["side"] == side]
        for ax, key in zip(axes, ("loss", "val_loss")):
            curves = [{r["iter"]: r[key] for r in recs if r.get(key) is not None} for recs in mine]
            iters = sorted(set.intersection(*(set(c) for c in curves)))
            if not iters:
                continue
            y = np.array([[c[it] for it in iters] for c in curves])  # (seeds, points)
            ax.plot(iters, y.mean(0), color=f"C{i}", label=f"{side}: mean of {len(curves)}")
            ax.fill_between(iters, y.min(0), y.max(0), color=f"C{i}", alpha=0.2, label=f"{side}: min to max")
    for ax, title in zip(axes, ("train loss (batch)", "val loss (the loop's evals)")):
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if result["target"]:
        axes[1].axhline(
            result["target"], color="gray", linestyle="--", linewidth=0.8, label=f"target {result['target']}"
        )
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- the comparison


def run(cfg, argv, rt):
    """Train A and B with each seed, interleaved; score, test, and write compare.md, compare.json
    and compare.png to compare_dir. Returns the result written to compare.json."""
    if rt.world_size > 1:
        raise UserError(
            "a comparison runs train.py once per seed and side, each in one process: start bench.py with "
            "python, not torchrun"
        )
    base = train_keys(argv)
    (args_a, cfg_a), (args_b, cfg_b) = (
        side_args(base, spec, side, key, cfg.compare_dir)
        for side, spec, key in (("A", cfg.compare, "compare"), ("B", cfg.against, "against"))
    )
    if cfg_a.dataset != cfg_b.dataset:
        raise UserError(
            f"A trains on {cfg_a.dataset!r} and B on {cfg_b.dataset!r}: their val losses are not comparable; "
            f"give both the same dataset"
        )
    if not (cfg_a.max_iters and cfg_b.max_iters):
        raise UserError("a side trains for max_iters=0: there is nothing to compare; give both sides some steps")
    seeds = side_seeds(seed_list(cfg.seeds))
    os.makedirs(cfg.compare_dir, exist_ok=True)
    runs, records = [], []
    order = [run for a, b in zip(seeds["A"], seeds["B"]) for run in ((a, "A", args_a, cfg_a), (b, "B", args_b, cfg_b))]
    for i, (seed, side, args, side_cfg) in enumerate(order, 1):
        print(f"run {i}/{len(order)}: {side}, seed {seed} ...", flush=True)
        r, recs = one_run(side, seed, args, side_cfg, cfg, rt)
        runs.append(r)
        records.append(recs)
        speed = "no steps logged" if r["ms_per_iter"] is None else f"{r['ms_per_iter']:.1f} ms/iter"
        print(f"  val loss {r['val_loss']:.4f} on {r['val_tokens']:,} tokens, {r['wall_s']:.1f} s, {speed}", flush=True)
    check_seeds_matter(runs)
    result = {
        "common": base,
        "compare": cfg.compare,
        "against": cfg.against,
        "args": {"A": args_a, "B": args_b},
        "seeds": seeds,
        "target": cfg.target,
        "compare_eval_tokens": cfg.compare_eval_tokens,
        "runs": runs,
        "summary": summarize(runs, cfg.target),
    }
    text = table(result)
    print(text)
    paths = {name: os.path.join(cfg.compare_dir, name) for name in ("compare.md", "compare.json", "compare.png")}
    with open(paths["compare.md"], "w") as f:
        f.write(text + "\n")
    with open(paths["compare.json"], "w") as f:
        json.dump(result, f, indent=1)
    plot(result, records, paths["compare.png"])
    print(f"wrote {', '.join(paths.values())}")
    return result
