"""bench.py --against: a comparison that can come out either way, its numbers against scipy's on the
runs it wrote, its refusals, and its files. The runs are train.py in this process, but in one test."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import CPU, read_metrics
from processes import run_script

import bench
from configurator import UserError
from gpt.evaluation import compare

LR = 1e-2


def bench_args(data_dir, tmp_path, **overrides):
    """bench.py's flags for a comparison of a 1-layer model trained 40 steps."""
    args = dict(device="cpu", compile=False, dataset=str(data_dir), n_layer=1, n_head=2, n_embd=32, block_size=32)
    args.update(batch_size=4, gradient_accumulation_steps=1, max_iters=40, lr_decay_iters=40, warmup_iters=2)
    args.update(eval_interval=10, eval_iters=2, log_interval=1, learning_rate=LR, min_lr=LR / 10)
    args.update(compare_dir=str(tmp_path / "cmp"))
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


def in_process(args, log_path):
    """compare.run_train, with train.py run in this process: the same script, ~1 s less a run."""
    result = run_script("train.py", *args)
    Path(log_path).write_text(result.stdout + result.stderr)
    return result.returncode


@pytest.fixture
def stats():
    """scipy.stats, imported only by the tests that use it (~1.9 s)."""
    from scipy import stats

    return stats


@pytest.fixture
def fast_runs(monkeypatch):
    monkeypatch.setattr(compare, "run_train", in_process)


def compare_run(data_dir, tmp_path, **overrides):
    bench.main(bench_args(data_dir, tmp_path, **overrides))
    return json.loads((tmp_path / "cmp" / "compare.json").read_text())


def side(result, name, key="val_loss"):
    return [r[key] for r in result["runs"] if r["side"] == name]


def test_a_clearly_worse_side_is_found_worse_and_the_numbers_are_scipys(char_data, tmp_path, fast_runs, capsys, stats):
    # B: a learning rate 30x too low; target: a val loss A's runs reach in 40 steps and B's do not
    result = compare_run(
        char_data, tmp_path, seeds=5, target=2.6, against=f"--learning_rate={LR / 30} --min_lr={LR / 300}"
    )
    out = capsys.readouterr().out
    runs = result["runs"]  # interleaved
    assert [(r["seed"], r["side"]) for r in runs] == [run for s in range(1, 6) for run in ((s, "A"), (s + 5, "B"))]
    a, b = side(result, "A"), side(result, "B")
    s = result["summary"]

    welch = stats.ttest_ind(b, a, equal_var=False)
    assert s["val_loss"]["B-A"]["p"] == pytest.approx(welch.pvalue, rel=1e-9) and welch.pvalue < 0.01
    assert s["val_loss"]["B-A"]["diff"] == pytest.approx(sum(b) / 5 - sum(a) / 5) and s["val_loss"]["B-A"]["diff"] > 0
    ci = welch.confidence_interval(0.95)
    assert (s["val_loss"]["B-A"]["low"], s["val_loss"]["B-A"]["high"]) == pytest.approx((ci.low, ci.high))
    for name, values in (("A", a), ("B", b)):
        low, high = stats.t.interval(0.95, 4, loc=sum(values) / 5, scale=stats.sem(values))
        assert (s["val_loss"][name]["low"], s["val_loss"][name]["high"]) == pytest.approx((low, high))
    ms = lambda name: sorted(side(result, name, "ms_per_iter"))[2]  # the median of 5
    assert s["ms_per_iter"]["B/A"] == pytest.approx(ms("B") / ms("A"))
    assert "B's val loss is higher than A's" in out and "| final val loss |" in out

    # time to target from the loop's evals in each run's own metrics.jsonl
    for r in runs:
        evals = [(m["iter"], m["val_loss"]) for m in read_metrics(r["out_dir"]) if "val_loss" in m]
        assert r["target_iter"] == next((it for it, loss in evals if loss <= 2.6), None)
    assert all(r["target_iter"] is not None for r in runs if r["side"] == "A")
    assert all(r["target_iter"] is None for r in runs if r["side"] == "B")
    assert "(5/5)" in out and "none reached (0/5)" in out

    # the val loss is eval.py's on the final checkpoint, on every val token
    which = [f"--out_dir={runs[3]['out_dir']}", "--checkpoint=latest", "--tasks=val", "--split_tokens=0"]
    scored = run_script("eval.py", *which, "--device=cpu", "--json=True")
    val_loss = json.loads(scored.stdout.strip().splitlines()[-1])["val"]["loss"]
    assert val_loss == pytest.approx(runs[3]["val_loss"], rel=1e-6)

    cmp_dir = tmp_path / "cmp"
    assert (cmp_dir / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| final val loss |" in (cmp_dir / "compare.md").read_text()


# B: A's own setting (two samples of one configuration), or dropout 0.01 (a change to the runs'
# randomness far below the spread between seeds)
@pytest.mark.parametrize("against", ["--dropout=0.0", "--dropout=0.01"], ids=["identical", "too-small"])
def test_no_difference_or_one_too_small_for_five_seeds_is_not_called_one(
    against, char_data, tmp_path, fast_runs, capsys, stats
):
    result = compare_run(char_data, tmp_path, seeds=5, max_iters=20, lr_decay_iters=20, against=against)
    verdict = [line for line in capsys.readouterr().out.splitlines() if line.startswith("no significant")]
    assert [r["seed"] for r in result["runs"] if r["side"] == "B"] == [6, 7, 8, 9, 10]  # B's own seeds, none of A's
    a, b = side(result, "A"), side(result, "B")
    assert len(set(a + b)) == 10  # ten different runs
    p = result["summary"]["val_loss"]["B-A"]["p"]
    assert p == pytest.approx(stats.ttest_ind(b, a, equal_var=False).pvalue) and p > 0.05
    assert verdict == [
        f"no significant difference at 0.05 (p = {p:.3g}, Welch's t-test): not evidence that the two are "
        f"equal; more seeds narrow the interval"
    ]


def test_repeats_of_one_seed_are_refused_before_training(char_data, tmp_path, capsys):
    with pytest.raises(UserError, match="repeats a seed"):
        bench.main(bench_args(char_data, tmp_path, seeds=(1, 2, 2), against="--dropout=0.1"))
    assert not (tmp_path / "cmp").exists()


def test_a_seed_that_does_not_reach_the_training_is_refused(char_data, tmp_path, fast_runs, monkeypatch):
    # as if the seed were pinned: every run gets seed 1 whatever the comparison asks
    flags = compare.run_flags
    monkeypatch.setattr(compare, "run_flags", lambda seed, out_dir: flags(1, out_dir))
    with pytest.raises(UserError, match="to the last bit: the seed does not change its training") as e:
        bench.main(bench_args(char_data, tmp_path, seeds=2, max_iters=10, lr_decay_iters=10, against="--dropout=0.0"))
    assert "\n" not in str(e.value)


def test_two_seeds_are_too_few_and_say_so(char_data, tmp_path, fast_runs, capsys):
    result = compare_run(
        char_data, tmp_path, seeds=2, max_iters=10, lr_decay_iters=10, against=f"--learning_rate={LR / 30}"
    )
    assert "2 seed(s) per side is too few to tell anything: no p-value" in capsys.readouterr().out
    assert result["summary"]["val_loss"]["B-A"]["p"] is None and result["summary"]["val_loss"]["A"]["low"] is not None


@pytest.mark.process
def test_the_runs_are_train_py_processes(char_data, tmp_path, capsys):
    # the product's own path: python train.py, a process per run, its output in <side>-s<seed>.log
    result = compare_run(
        char_data, tmp_path, seeds=1, max_iters=10, lr_decay_iters=10, against=f"--learning_rate={LR / 30}"
    )
    assert "1 seed(s) per side is too few" in capsys.readouterr().out
    assert all(math.isfinite(r["val_loss"]) and r["wall_s"] > 0 for r in result["runs"])
    assert "iter 9: loss" in (tmp_path / "cmp" / "B-s2.log").read_text()
    assert json.loads((tmp_path / "cmp" / "B-s2" / "config.json").read_text())["learning_rate"] == pytest.approx(
        LR / 30
    )


def test_a_mistake_in_a_side_is_one_line_before_any_run(char_data, tmp_path):
    with pytest.raises(UserError, match=r"^side B \(--against\): n_embd=32 is not divisible by n_head=5"):
        bench.main(bench_args(char_data, tmp_path, against="--n_head=5"))
    with pytest.raises(UserError, match="name side B with --against"):
        bench.main(bench_args(char_data, tmp_path, compare="--dropout=0.1"))


def test_only_train_keys_and_config_files_pass_to_the_sides():
    argv = ["config/x.py", "--max_iters=5", "--bench_iters=3", "--against=--mlp=swiglu", "--seeds=3"]
    assert compare.train_keys(argv) == ["config/x.py", "--max_iters=5"]


def test_a_failed_run_stops_the_comparison_in_one_line_and_a_time_budget_is_a_finish(char_data, tmp_path, fast_runs):
    with pytest.raises(
        UserError,
        match=r"^side B, seed 2: train.py exited with 2 \(error: block_size=4096 is longer "
        r"than .*\); its output is in .*B-s2\.log$",
    ):
        compare_run(char_data, tmp_path, seeds=1, max_iters=10, lr_decay_iters=10, against="--block_size=4096")
    # max_minutes stops B with a checkpoint (exit 75) long before max_iters: it is scored as it stands
    result = compare_run(
        char_data,
        tmp_path,
        seeds=1,
        max_iters=10,
        lr_decay_iters=10,
        against="--max_minutes=1e-6 --max_iters=100000 --lr_decay_iters=100000",
    )
    stopped = result["runs"][1]
    assert "stopped at iter" in Path(stopped["out_dir"] + ".log").read_text()
    assert max(r["iter"] for r in read_metrics(stopped["out_dir"])) < 1000 and math.isfinite(stopped["val_loss"])


def test_scoring_on_a_gpu_hands_its_cached_memory_back_before_the_next_run(tiny_run, monkeypatch):
    # the parent scores between runs; on CUDA what its allocator cached would be missing from the next train.py
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # no CUDA here to pin host memory for
    data = str(tiny_run.parent / "chars")  # tiny_run's dataset
    on_cpu = compare.score(str(tiny_run), data, CPU, 0)
    assert emptied == []
    as_cuda = compare.score(str(tiny_run), data, dataclasses.replace(CPU, device_type="cuda"), 0)
    assert emptied == [True] and as_cuda == on_cpu
