"""Seeing a run: metrics.jsonl, wandb (offline) and TensorBoard fed the same records, and
plot.py turning metrics.jsonl files into a PNG."""

import importlib.util
import struct

import pytest
from conftest import char_dataset, needs, read_metrics, tiny_args
from processes import run_script

from gpt.outdir import checkpoint


@pytest.mark.process
def test_wandb_offline_run_continues_the_same_run_after_resume(char_data, tmp_path):
    needs("wandb")
    out = tmp_path / "out"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # isolated: wandb keeps a service process and module state per interpreter
    first = run_script("train.py", *tiny_args(char_data, out, max_iters=4, wandb_log=True), env=env, isolated=True)
    assert first.returncode == 0, first.stderr
    run_id = checkpoint.load(str(out / "ckpt.pt"))["wandb_run_id"]
    assert run_id

    resumed = run_script(
        "train.py", *tiny_args(char_data, out, max_iters=8, wandb_log=True, init_from="resume"), env=env, isolated=True
    )
    assert resumed.returncode == 0, resumed.stderr
    assert checkpoint.load(str(out / "ckpt.pt"))["wandb_run_id"] == run_id
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), runs
    # each offline run holds its own records: the first up to iter 4, the resumed one from 4 on
    assert all((out / "wandb" / name / f"run-{run_id}.wandb").stat().st_size > 0 for name in runs)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two 10-step runs at learning rates 1e-2 and 3e-3, for plot.py; the first also logs to
    TensorBoard (where it is installed), with update ratios every 5 steps."""
    root = tmp_path_factory.mktemp("logging")
    data = char_dataset(root / "chars")
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    for name, lr, extra in (("a", 1e-2, dict(tensorboard_log=tensorboard, update_ratio_interval=5)), ("b", 3e-3, {})):
        args = tiny_args(data, root / name, max_iters=10, learning_rate=lr, min_lr=lr / 10, **extra)
        result = run_script("train.py", *args)
        assert result.returncode == 0, result.stderr
    return root


def test_tensorboard_gets_the_same_scalars_as_metrics_jsonl(two_runs):
    needs("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = two_runs / "a"
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = read_metrics(out)
    for key in ("loss", "lr", "val_loss", "train_loss", "grad_norm", "clipped", "update_ratio/h.0", "update_ratio/wte"):
        logged = [(r["iter"], r[key]) for r in records if r.get(key) is not None]
        scalars = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in scalars] == [i for i, _ in logged]
        # stored as float32
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(scalars, logged))


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_two_runs_into_one_png(two_runs, tmp_path):
    result = run_script("plot.py", two_runs / "a", two_runs / "b" / "metrics.jsonl", f"--out={tmp_path / 'cmp.png'}")
    assert result.returncode == 0, result.stderr
    width, height = png_size(tmp_path / "cmp.png")
    assert width > 1000 and height > 300

    alone = run_script("plot.py", two_runs / "b")  # default: beside the run's metrics
    assert alone.returncode == 0 and (two_runs / "b" / "metrics.png").exists()


def test_plot_refuses_what_is_not_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    for path in (tmp_path / "missing", tmp_path / "notes.txt"):
        result = run_script("plot.py", path)
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and str(path.name) in result.stderr
