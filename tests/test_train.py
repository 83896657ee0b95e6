"""End-to-end: train.py and sample.py as a user runs them, on data made here."""

import dataclasses
import json
import os
import re
import textwrap

import pytest
import torch
from conftest import read_metrics, tiny_args
from processes import REPO, run_python, run_script

from configurator import TrainConfig
from gpt.outdir import checkpoint


def train(data_dir, out_dir, **overrides):
    result = run_script("train.py", *tiny_args(data_dir, out_dir, **overrides))
    assert result.returncode == 0, result.stderr
    return result


def test_training_run_learns_and_writes_its_outputs(char_data, tmp_path):
    out = tmp_path / "out"
    result = train(char_data, out, max_iters=60, lr_decay_iters=60, eval_interval=30)
    records = read_metrics(out)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["iter"] for r in steps] == list(range(60))
    assert [r["iter"] for r in evals] == [0, 30, 60]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5  # it learned something
    assert all(set(r) == {"iter", "loss", "lr", "grad_norm", "clipped", "dt_ms", "tokens_per_s", "mfu"} for r in steps)

    assert json.loads((out / "config.json").read_text())["max_iters"] == 60
    state = checkpoint.load(str(out / "ckpt.pt"))  # loads with weights_only=True
    assert state["iter_num"] == 60
    assert not any(k.startswith("_orig_mod.") for k in state["model"])
    chars = json.loads((char_data / "meta.json").read_text())["chars"]
    assert state["config"]["n_embd"] == 32 and state["model_args"]["vocab_size"] == len(chars)
    assert state["tokenizer"]["kind"] == "char"
    assert state["best_val_loss"] == min(e["val_loss"] for e in evals)
    assert os.path.exists(out / "ckpt_best.pt")
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]

    # it opens with the keys set away from the defaults, and ends with one line: how long, the
    # best val and where, the checkpoint, the command that samples from it
    lines = result.stdout.splitlines()
    assert lines[0].startswith("config, where it differs from the defaults (python train.py --help): out_dir=")
    opening = " ".join(lines[: next(i for i, line in enumerate(lines) if "parameters |" in line)])
    assert "max_iters=60" in opening and "n_embd=32" in opening
    assert "beta1=" not in opening and "weight_decay=" not in opening  # defaults, left out
    best, best_iter = min((e["val_loss"], e["iter"]) for e in evals)
    assert re.fullmatch(
        rf"done: iter 60 in \dm\d\ds, best val loss {best:.4f} at iter {best_iter}, in {out}/ckpt_best.pt; "
        rf"sample from it: python sample.py --out_dir={out}",
        lines[-1],
    ), lines[-1]


def test_help_lists_every_key():
    result = run_script("train.py", "--help")
    assert result.returncode == 0
    listed = {line.split("=")[0].strip().removeprefix("--") for line in result.stdout.splitlines()[1:]}
    assert listed == {f.name for f in dataclasses.fields(TrainConfig)}


def test_a_resume_past_lr_decay_iters_says_it_runs_at_min_lr(char_data, tmp_path):
    """The README's "train longer": the steps past lr_decay_iters run at min_lr, and the run says so."""
    out = tmp_path / "out"
    first = train(char_data, out, max_iters=4, lr_decay_iters=4, eval_interval=4)
    assert "note: iters" not in first.stdout  # nothing to say when the cosine ends at max_iters
    longer = train(char_data, out, max_iters=6, lr_decay_iters=4, eval_interval=4, init_from="resume")
    note = (
        "note: iters 4-6 run at min_lr=0.001, past the cosine's end at lr_decay_iters=4; "
        "to decay over them instead, pass --lr_decay_iters=6"
    )
    assert note in longer.stdout.splitlines()
    assert [r["lr"] for r in read_metrics(out) if "lr" in r and r["iter"] >= 4] == [1e-3, 1e-3]


HIGH_LR = dict(learning_rate=0.3, min_lr=0.3)  # val loss goes up and down: best must only ever fall


def test_best_val_loss_is_never_overwritten_by_a_worse_one(char_data, tmp_path):
    out = tmp_path / "out"
    train(char_data, out, max_iters=30, lr_decay_iters=30, eval_interval=3, always_save_checkpoint=True, **HIGH_LR)
    evals = [r["val_loss"] for r in read_metrics(out) if "val_loss" in r]
    state = checkpoint.load(str(out / "ckpt.pt"))
    assert state["best_val_loss"] == min(evals)
    best = checkpoint.load(str(out / "ckpt_best.pt"))
    best_iter = 3 * evals.index(min(evals))
    assert best["iter_num"] == best_iter and best["best_val_iter"] == best_iter
    # what sample.py (and serve.py, chat.py) say of each: the best's own val; of the last, that its
    # figure is an earlier iter's (the last eval was worse here: the learning rate is that high)
    assert best_iter != 30
    loaded = lambda which: run_script("sample.py", f"--out_dir={out}", f"--checkpoint={which}", "--max_new_tokens=1")
    assert f"(iter {best_iter}, val loss {min(evals):.4f}, the run's best)" in loaded("best").stdout
    expected = f"(iter 30; the run's best val loss before it: {min(evals):.4f} at iter {best_iter})"
    assert expected in loaded("latest").stdout


KILL_DURING_SAVE = textwrap.dedent("""
    import io, os, signal, sys, torch
    sys.path.insert(0, {repo!r})
    from gpt.outdir import checkpoint
    path = sys.argv[1]
    checkpoint.save({{"model": {{"w": torch.zeros(1000)}}, "model_args": {{}}, "iter_num": 1}}, path)

    class DiesMidway(io.FileIO):
        written = 0
        def write(self, b):
            room = 100_000 - DiesMidway.written
            if len(b) > room:  # put the first 100 kB of the new checkpoint on disk, then die
                super().write(bytes(b)[:room])
                os.kill(os.getpid(), signal.SIGKILL)
            DiesMidway.written += len(b)
            return super().write(b)

    checkpoint.open = DiesMidway  # checkpoint.save opens its temporary file through this name
    checkpoint.save({{"model": {{"w": torch.ones(1_000_000)}}, "model_args": {{}}, "iter_num": 2}}, path)
""")


@pytest.mark.process
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_SAVE.format(repo=str(REPO)))
    path = tmp_path / "ckpt.pt"
    result = run_python([script, path])  # a process of its own, which kills itself
    assert result.returncode == -9, result.stderr
    assert os.path.getsize(str(path) + ".tmp") == 100_000  # the half-written file exists...
    state = checkpoint.load(str(path))  # ...and the checkpoint is the old one, whole
    assert state["iter_num"] == 1 and torch.equal(state["model"]["w"], torch.zeros(1000))
    checkpoint.save({"model": {}, "model_args": {}, "iter_num": 3}, str(path))  # the next save just works
    assert checkpoint.load(str(path))["iter_num"] == 3


def test_sample_from_a_trained_checkpoint(tiny_run):
    chars = json.loads((tiny_run.parent / "chars" / "meta.json").read_text())["chars"]
    args = ["--out_dir=" + str(tiny_run), "--device=cpu", "--num_samples=2", "--max_new_tokens=40", "--start=The king"]
    first, again = run_script("sample.py", *args), run_script("sample.py", *args)
    other_seed = run_script("sample.py", *args, "--seed=7")
    assert first.returncode == 0, first.stderr
    samples = first.stdout.split("---------------\n")[:-1]
    assert len(samples) == 2
    body = samples[0].split("\n", 1)[1]  # after the 'loaded ...' line
    assert body.startswith("The king") and len(body.rstrip("\n")) >= 40
    assert set(body) <= set(chars) | {"\n"}
    assert first.stdout == again.stdout  # the seed makes it reproducible
    assert other_seed.stdout != first.stdout
    greedy = run_script("sample.py", *args, "--temperature=0")
    samples = greedy.stdout.split("---------------\n")[:-1]
    assert len(samples) == 2 and samples[1] == samples[0].split("\n", 1)[1]  # one text twice (after 'loaded ...')
    note = "note: temperature=0 is greedy: the 2 samples of a prompt are one text; --num_samples=1 draws it once"
    assert note in greedy.stderr.splitlines()


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    """A model trained on the real tiny Shakespeare (SHAKESPEARE_TXT; the tests skip without it): 2
    layers of 96, 400 steps, evaluated at 0 and 400 (val 2.25 at 400; 128 wide at a learning rate of
    5e-3 took 1.4 times as long for 2.21). Its out_dir."""
    if not os.environ.get("SHAKESPEARE_TXT"):
        pytest.skip("set SHAKESPEARE_TXT to the tiny Shakespeare text")

    root = tmp_path_factory.mktemp("shakespeare")
    prepare = ["--input", os.environ["SHAKESPEARE_TXT"], "--out_dir", root / "data"]
    prepared = run_script("data/shakespeare_char/prepare.py", *prepare)
    assert prepared.returncode == 0, prepared.stderr
    model = dict(n_head=4, n_embd=96, block_size=64, batch_size=12, learning_rate=7e-3, min_lr=7e-4)
    steps = dict(max_iters=400, lr_decay_iters=400, warmup_iters=50, eval_interval=400, eval_iters=20)
    trained = run_script("train.py", *tiny_args(root / "data", root / "out", **model, **steps))
    assert trained.returncode == 0, trained.stderr
    return root / "out"


@pytest.mark.slow
def test_real_shakespeare_learns(shakespeare):
    final = [r for r in read_metrics(shakespeare) if "val_loss" in r][-1]
    assert final["iter"] == 400
    # a unigram model of this text scores about 3.3 and the untrained one ln(65) = 4.17
    assert final["val_loss"] < 2.3


@pytest.mark.slow
def test_real_shakespeare_cached_equals_uncached_for_500_greedy_tokens(shakespeare):
    greedy = ["--device=cpu", "--temperature=0", "--num_samples=1", "--max_new_tokens=500", "--start=ROMEO:"]
    args = [f"--out_dir={shakespeare}", *greedy]
    cached, uncached = run_script("sample.py", *args), run_script("sample.py", *args, "--kv_cache=False")
    assert cached.returncode == 0, cached.stderr
    assert len(cached.stdout) > 500 and cached.stdout == uncached.stdout
