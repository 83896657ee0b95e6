"""Shared test helpers: a tiny character dataset made on the spot, and running the scripts."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def load_script(relpath):
    """Import a script that lives outside a package (data/<name>/prepare.py) as a module."""
    spec = importlib.util.spec_from_file_location(Path(relpath).stem, REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_text(n_chars=20000, seed=0):
    """Text with learnable structure: words from a small vocabulary, lines, punctuation."""
    rng = np.random.default_rng(seed)
    words = ["the", "king", "queen", "shall", "not", "be", "my", "lord", "what", "is", "love", "death", "now"]
    out, size = [], 0
    while size < n_chars:
        line = " ".join(rng.choice(words, size=rng.integers(3, 9))).capitalize() + rng.choice([".", "!", "?", ","])
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)[:n_chars]


@pytest.fixture
def char_data(tmp_path):
    """A prepared character-level dataset directory (train.bin, val.bin, meta.json)."""
    data_dir = tmp_path / "chars"
    data_dir.mkdir()
    load_script("data/shakespeare_char/prepare.py").prepare(make_text(), str(data_dir))
    return data_dir


def train_tiny_run(root, **overrides):
    """root/out: a tiny character model trained on root/chars for a few steps (block_size 16)."""
    data_dir = root / "chars"
    data_dir.mkdir()
    load_script("data/shakespeare_char/prepare.py").prepare(make_text(), str(data_dir))
    result = run_script("train.py", *tiny_args(data_dir, root / "out", **overrides))
    assert result.returncode == 0, result.stderr
    return root / "out"


def tiny_args(data_dir, out_dir, **overrides):
    """train.py flags for a model that trains in seconds on a CPU."""
    args = dict(
        device="cpu", compile=False, dataset=str(data_dir), out_dir=str(out_dir),
        n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4, gradient_accumulation_steps=1,
        max_iters=20, lr_decay_iters=20, warmup_iters=2, eval_interval=10, eval_iters=2, log_interval=1,
        learning_rate=1e-2, min_lr=1e-3, dropout=0.0,
    )
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


def run_script(script, *args, cwd=REPO, env=None, timeout=300):
    """Run one of the repo's scripts in a fresh interpreter; returns the CompletedProcess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / script), *map(str, args)],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def read_metrics(out_dir):
    import json

    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
