"""scripts/headline.py: its CPU mode end to end (each step a real command in a process of its own), the
plan it runs on a GPU (parsed as bench.py and train.py parse it), a hung step killed with its children,
a spent budget, and what nanoGPT's commands and pytest print, read as they print it."""

import json
import math
import time

import pytest
import torch
from conftest import char_dataset, one_line_error
from processes import REPO, load_script, run_script

import configurator
from configurator import BenchConfig, TrainConfig, UserError

headline = load_script("scripts/headline.py")


@pytest.mark.process
def test_cpu_mode_runs_every_part_and_writes_its_reports(tmp_path, monkeypatch):
    work = tmp_path / "work"
    char_dataset(work / "data" / "shakespeare_char")  # the baby GPT trains on data/shakespeare_char
    monkeypatch.chdir(work)
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:schemathesis -p no:hypothesispytest")  # as make test: 1.5 CPU-s less
    assert headline.main(["--device=cpu", f"--out_dir={work / 'report'}", "--budget_s=0", "--baby_seeds=1"]) == 0
    report = json.loads((work / "report" / "report.json").read_text())
    assert report["torch"] == torch.__version__ and report["gpu"] is None
    baby = ["baby-cold-fast-1", "baby-warmup-fast", "baby-warm-fast-1"]
    names = ["speedrun", "plain", *baby, "gpt2-2", "tests", "gpt2-4", "llama", "baby-config-1"]
    assert [(s["name"], s["status"]) for s in report["steps"]] == [(n, "ok") for n in names]
    rows = {(s["name"], r["setting"]): r for s in report["steps"] for r in s.get("rows", [])}
    sweep = ["gradient_accumulation_steps=1", "gradient_accumulation_steps=2"]
    expected = [("gpt2-2", ""), ("gpt2-4", ""), ("llama", "")] + [(n, k) for n in ("speedrun", "plain") for k in sweep]
    assert sorted(rows) == sorted(expected)
    assert all(r["tokens_per_s"] > 0 and r["ms_per_iter"] > 0 for r in rows.values())
    assert (rows[("gpt2-4", "")]["batch_size"], rows[("gpt2-2", "")]["gradient_accumulation_steps"]) == (4, 1)
    for accum, fast, plain, ratio in report["speedrun_over_plain"]:
        key = ("speedrun", f"gradient_accumulation_steps={accum}")
        plain_tokens_per_s = rows[("plain", key[1])]["tokens_per_s"]
        assert fast == rows[key]["tokens_per_s"] and ratio == pytest.approx(fast / plain_tokens_per_s)
    baby = report["baby"]
    assert baby["target"] == headline.NANOGPT_BEST_H200  # no nanoGPT here
    assert all(race["nanogpt_s"] is None for race in baby["races"].values())
    assert list(baby["races"]) == ["cold", "warm"]
    assert [r["name"] for r in baby["runs"]] == ["baby-cold-fast-1", "baby-warm-fast-1", "baby-config-1"]
    caches = work / "report" / "caches"
    assert sorted(p.name for p in caches.iterdir()) == ["baby-cold-fast-1", "warm-fast"]  # each side's, each cold run's
    for step in (s for s in report["steps"] if s["kind"] == "train"):
        assert [e[0] for e in step["evals"]] == [0, 10, 20] and step["ms_per_iter"] > 0
        assert min(e[1] for e in step["evals"]) < math.log(65)  # below a uniform guess: they trained
    tests = next(s for s in report["steps"] if s["name"] == "tests")
    assert set(tests["counts"]) == {"skipped"} and tests["counts"]["skipped"] >= 1  # every GPU test skips here
    markdown = (work / "report" / "report.md").read_text()
    for title in ("Training step", "The speedrun recipe against plain GPT-2", "Baby GPT", "tests/test_gpu.py"):
        assert f"## {title}" in markdown
    assert all((work / "report" / "logs" / f"{n}.log").exists() for n in names)


@pytest.fixture
def nanogpt(tmp_path):
    """A directory with the files HeadlineConfig checks a nanoGPT checkout for (the plan runs nothing)."""
    root = tmp_path / "nanoGPT"
    (root / "data" / "shakespeare_char").mkdir(parents=True)
    for name in ("bench.py", "train.py", "model.py", "data/shakespeare_char/meta.pkl"):
        (root / name).touch()
    return root


def test_on_a_gpu_it_plans_the_issues_commands_at_full_shape(nanogpt, tmp_path, monkeypatch):
    cfg = headline.HeadlineConfig(nanogpt=str(nanogpt), out_dir=str(tmp_path / "h"))
    steps = headline.plan(cfg, "cuda")
    races = lambda cache: [f"baby-{cache}-{side}-{seed}" for seed in (1, 2) for side in ("nanogpt", "fast")]
    baby = [*races("cold"), "baby-warmup-nanogpt", "baby-warmup-fast", *races("warm")]  # the warm-ups fill the caches
    gpt2 = ["gpt2-12", "nanogpt-gpt2-12", "tests", "gpt2-32", "nanogpt-gpt2-32"]
    assert [s.name for s in steps] == ["speedrun", "plain", *baby, *gpt2, "llama", "baby-config-1"]
    by = {s.name: s for s in steps}
    ours = lambda name, cls=BenchConfig: configurator.parse(cls, by[name].argv[1:])  # as bench.py, train.py parse them
    speedrun, plain = ours("speedrun"), ours("plain")
    for c in (speedrun, plain):
        shape = (c.batch_size, c.block_size, c.sweep, c.device, c.compile)
        assert shape == (16, 1024, "gradient_accumulation_steps=1,8,32", "cuda", True)
    assert (speedrun.optimizer, speedrun.value_embeds, plain.optimizer, plain.n_head) == ("muon", True, "adamw", 12)
    for batch in (12, 32):  # the issue's command, and nanoGPT's bench.py at the same shape
        c = ours(f"gpt2-{batch}")
        shape = (c.n_layer, c.n_embd, c.batch_size, c.block_size, c.gradient_accumulation_steps)
        assert shape == (12, 768, batch, 1024, 1)
        assert (c.bench_iters, c.bench_warmup, c.bias, c.json) == (20, 10, False, True)
        nano = by[f"nanogpt-gpt2-{batch}"]
        command = [str(nanogpt / "bench.py"), "--real_data=False", f"--batch_size={batch}"]
        assert (nano.argv, nano.cwd) == (command, str(nanogpt))
    llama = ours("llama")
    assert (llama.n_layer, llama.n_embd, llama.gradient_accumulation_steps, llama.bench_iters) == (16, 2048, 2, 3)
    caches = {name: s.env["TORCHINDUCTOR_CACHE_DIR"] for name, s in by.items() if s.part == "baby"}
    cold = [caches[f"baby-cold-{side}-{seed}"] for side in ("nanogpt", "fast") for seed in (1, 2)]
    assert len(set(cold)) == 4 and all(by[n].env["TRITON_CACHE_DIR"].startswith(caches[n]) for n in caches)
    for side in ("nanogpt", "fast"):  # the warm runs share the cache their side's warm-up filled
        assert {caches[f"baby-warm-{side}-{seed}"] for seed in (1, 2)} == {caches[f"baby-warmup-{side}"]}
    assert ours("baby-warmup-fast", TrainConfig).max_iters == 20 and "--max_iters=20" in by["baby-warmup-nanogpt"].argv
    for seed in (1, 2):
        fast = ours(f"baby-warm-fast-{seed}", TrainConfig)
        run = (fast.seed, fast.optimizer, fast.max_iters, fast.n_embd, fast.device)
        assert run == (seed, "muon", 1000, 384, "cuda")
        nano = by[f"baby-cold-nanogpt-{seed}"]
        command = ["train.py", "config/train_shakespeare_char.py", "--max_iters=2000", "--device=cuda"]
        assert nano.cwd == str(nanogpt) and nano.argv[:4] == command
    config = ours("baby-config-1", TrainConfig)  # nanoGPT's config, its schedule unchanged to step 2,000
    assert (config.max_iters, config.lr_decay_iters, config.optimizer, config.dropout) == (2000, 5000, "adamw", 0.2)
    assert by["tests"].argv[-1] == "tests/test_gpu.py" and by["tests"].cwd == str(REPO)
    assert max(s.limit_s for s in steps) <= 240
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert headline.environment("cuda")["gpu"] == "NVIDIA H100 80GB HBM3"


def python_step(name, code, limit_s, tmp_path):
    return headline.Step(name, "tests", "pytest", ["-c", code], str(tmp_path), limit_s)


@pytest.mark.process
def test_a_step_past_its_limit_is_killed_with_its_children_and_a_spent_budget_runs_nothing_more(tmp_path, monkeypatch):
    # the step starts a child that sleeps as it does, and prints the child's pid
    child = "[sys.executable, '-c', 'import time; time.sleep(600)']"
    hang = f"import subprocess, sys, time; c = subprocess.Popen({child}); print(c.pid, flush=True); time.sleep(600)"
    quick = "print('=== 3 passed, 1 skipped in 0.12s ===')"
    cfg = headline.HeadlineConfig(out_dir=str(tmp_path / "h"), budget_s=0)
    steps = [python_step("hang", hang, 3, tmp_path), python_step("quick", quick, 60, tmp_path)]
    done = headline.run_all(cfg, steps, lambda done: None, time.perf_counter())
    assert [s["status"] for s in done] == ["timeout", "ok"]
    assert done[1]["counts"] == {"passed": 3, "skipped": 1}
    child = int((tmp_path / "h" / "logs" / "hang.log").read_text().splitlines()[2])
    assert process_gone(child)  # the hung step's own child went with its process group
    # a budget with 3 s left: the hang is stopped by it, and nothing starts after
    monkeypatch.setattr(headline, "START_MIN_S", 1)
    cfg = headline.HeadlineConfig(out_dir=str(tmp_path / "b"), budget_s=100)
    done = headline.run_all(cfg, steps, lambda done: None, time.perf_counter() - 97)
    assert [s["status"] for s in done] == ["stopped: budget", "not run: budget"]


def process_gone(pid):
    """pid has exited (a zombie waiting for init to reap it counts): polled, since init reaps when it gets to it."""
    for _ in range(100):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_what_nanogpts_commands_and_pytest_print_is_read_as_they_print_it():
    timed = lambda lines: [(float(i), line + "\n") for i, line in enumerate(lines)]
    bench = headline.Step("nanogpt-gpt2-12", "gpt2", "nanogpt_bench", [], "", 1, {"tokens": 12 * 1024})
    # nanoGPT's bench.py: its burn-in and timed steps, then one summary line
    lines = timed(
        [
            "Compiling model...",
            "0/10 loss: 10.9862",
            "19/20 loss: 10.8131",
            "time per iteration: 26.0412ms, MFU: 40.12%",
        ]
    )
    row = headline.read_result(bench, lines)["rows"][0]
    assert row["ms_per_iter"] == 26.0412 and row["tokens_per_s"] == pytest.approx(12 * 1024 / 0.0260412)
    # nanoGPT's train.py (its print formats), then ours
    train = headline.Step("baby-nanogpt-1", "baby", "nanogpt_train", [], "", 1, {"side": "nanogpt"})
    nano = [
        "step 0: train loss 4.2874, val loss 4.2823",
        "iter 0: loss 4.2654, time 29823.53ms, mfu -100.00%",
        "iter 10: loss 3.2402, time 12.10ms, mfu 9.03%",
        "iter 20: loss 2.7901, time 11.90ms, mfu 9.05%",
        "iter 30: loss 2.6000, time 12.50ms, mfu 9.01%",
        "step 250: train loss 1.9697, val loss 2.0675",
        "saving checkpoint to out-shakespeare-char",
    ]
    result = headline.read_result(train, timed(nano))
    assert result == {"evals": [(0, 4.2823, 0.0), (250, 2.0675, 5.0)], "ms_per_iter": 12.10}  # past iter 0's compile
    ours = [
        "step 0: train loss 4.1832, val loss 4.1856 (6.0385 bpb)",
        "iter 0: loss 4.1800, lr 1.50e-04, grad norm 2.1, 900.0 ms/iter, 1,100 tok/s, 0.01 TFLOPS/device, mfu n/a, eta 5s",
        "iter 50: loss 2.3100, lr 3.00e-03, grad norm 0.51 (clipped), 12.3 ms/iter, 83,000 tok/s, 5.2 TFLOPS/device, mfu 1.0%, eta 1s",
        "step 100: train loss 2.3629, val loss 2.3725 (3.4228 bpb)",
    ]
    assert headline.read_result(train, timed(ours)) == {
        "evals": [(0, 4.1856, 0.0), (100, 2.3725, 3.0)],
        "ms_per_iter": 12.3,
    }
    tests = headline.Step("tests", "tests", "pytest", [], "", 1)
    summary = "==== 2 failed, 14 passed, 9 skipped, 1 error in 41.19s ===="
    assert headline.read_result(tests, timed([summary]))["counts"] == dict(failed=2, passed=14, skipped=9, error=1)


def run_record(name, side, evals, cache="cold"):
    kind = "nanogpt_train" if side == "nanogpt" else "train"
    meta = {"side": side, "cache": cache}
    return dict(name=name, kind=kind, meta=meta, evals=evals, ms_per_iter=10.0, seconds=60.0, status="ok")


def test_the_baby_race_counts_nanogpt_to_its_best_and_ours_to_that_val_cache_against_cache():
    nano = [
        run_record("baby-cold-nanogpt-1", "nanogpt", [(0, 4.28, 20.0), (1750, 1.4784, 58.8), (2000, 1.4801, 64.0)]),
        run_record("baby-cold-nanogpt-2", "nanogpt", [(0, 4.28, 8.0), (1500, 1.4790, 41.2), (1750, 1.4795, 46.0)]),
    ]
    fast = [
        run_record(
            "baby-cold-fast-1", "fast", [(0, 4.2, 3.0), (800, 1.4801, 17.0), (900, 1.4780, 19.5), (1000, 1.47, 21.0)]
        ),
        run_record("baby-cold-fast-2", "fast", [(0, 4.2, 3.0), (900, 1.4786, 18.0), (1000, 1.4760, 20.0)]),
    ]
    warm = [
        run_record("baby-warm-nanogpt-1", "nanogpt", [(0, 4.28, 5.0), (1750, 1.4770, 30.0)], "warm"),
        run_record("baby-warm-fast-1", "fast", [(0, 4.2, 1.0), (900, 1.4780, 12.0)], "warm"),
    ]
    summary = headline.baby_summary(nano + fast + warm)
    assert summary["target"] == pytest.approx(1.4784)  # the median of nanoGPT's bests, cold and warm
    assert [r["seconds_counted"] for r in summary["runs"]] == [58.8, 41.2, 19.5, 20.0, 30.0, 12.0]
    cold, hot = summary["races"]["cold"], summary["races"]["warm"]
    assert cold["nanogpt_s"] == pytest.approx(50.0) and cold["fast_s"] == pytest.approx(19.75)
    assert cold["ratio"] == pytest.approx(19.75 / 50.0)
    assert (hot["nanogpt_s"], hot["fast_s"], hot["ratio"]) == (30.0, 12.0, pytest.approx(0.4))
    # a run that never gets there: with one of two never there, the median is never there either
    slow = run_record("baby-cold-fast-2", "fast", [(0, 4.2, 3.0), (1000, 1.4900, 20.0)])
    summary = headline.baby_summary(nano + fast[:1] + [slow])
    cold = summary["races"]["cold"]
    assert summary["runs"][-1]["at_target"] is None and cold["fast_s"] is None and cold["ratio"] is None


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--nanogpt=/nonexistent/nanoGPT"], "is not a nanoGPT checkout"),
        (["--parts=speedrun,sweep"], "parts: 'sweep' not among speedrun, baby"),
        (["--baby_fast=config/none.py"], "baby_fast='config/none.py' is not a config file"),
        (["--baby_caches=hot"], "baby_caches='hot': give 'cold', 'warm' or 'cold,warm'"),
    ],
)
def test_bad_input_is_one_line(args, expected):
    with pytest.raises(UserError, match=expected) as e:
        headline.HeadlineConfig(**dict(a.lstrip("-").split("=", 1) for a in args))
    assert "\n" not in str(e.value)


def test_an_unprepared_nanogpt_is_one_line_from_the_command(nanogpt, tmp_path):
    (nanogpt / "data" / "shakespeare_char" / "meta.pkl").unlink()
    result = run_script("scripts/headline.py", f"--nanogpt={nanogpt}", f"--out_dir={tmp_path / 'h'}")
    one_line_error(result, "is not prepared: run python data/shakespeare_char/prepare.py in")
    assert result.returncode == 2
    assert not (tmp_path / "h").exists()  # refused before anything ran or was written
