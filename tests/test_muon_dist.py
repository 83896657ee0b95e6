"""Muon shared out across ranks on CPU processes over gloo under torchrun: under DDP each rank
orthogonalizes its share of the matrices and keeps only their momenta, under FSDP2 each matrix's rows
go to one rank and back; both train as one process does, and resume on the same world size or another.

The runs: config/train_llama_1b.py at tiny shapes (GQA, SwiGLU), Muon, 20 steps, a full checkpoint
every 5: one (one process), ddp2 and ddp4 (DDP over 2 and 4 ranks), fsdp2 (FSDP2 over 2), one_fsdp2
and fsdp2_one (one's and fsdp2's iter-10 checkpoints resumed on 2 ranks and on 1). Only the order of
the reductions' additions differs: losses agree within rel 1e-5, abs 1e-6 (measured 1.8e-7), weights and
momenta within rel 1e-4, abs 1e-5 (measured 1.1e-6: Newton-Schulz spreads a gradient's last bit).
muon_ranks: tests/muon_rank.py, Muon itself on 14 bare matrices over 4 ranks, then resumed through DCP."""

import json
import os
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
from conftest import char_dataset, losses, read_metrics, tiny_args, untimed
from processes import run_python, run_script, start_python

from gpt.train.muon import assign

no_gloo = not dist.is_available() or not dist.is_gloo_available()
# every test here reads torchrun launches
pytestmark = [pytest.mark.skipif(no_gloo, reason="needs torch.distributed with gloo"), pytest.mark.process]

LLAMA = dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64, dtype="float32", batch_size=2)
# 2 ranks x 2 micro-steps, or 4 x 1; a full checkpoint every 5 steps, each kept
RUN = dict(gradient_accumulation_steps=4, eval_interval=5, always_save_checkpoint=True, keep_last=4)
RUN.update(optimizer="muon", checkpoint_format="full", muon_weight_decay=0.01)
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def args(data, out, **overrides):
    return ["config/train_llama_1b.py", *tiny_args(data, out, **{**LLAMA, **RUN, **overrides})]


def torchrun(nproc, *argv):
    """python's arguments for argv (a script and its arguments) under a standalone torchrun of nproc CPU ranks."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv]


def on_ranks(nproc, argv):
    """train.py argv on nproc ranks; it must succeed."""
    result = run_python(torchrun(nproc, "train.py", *argv), env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def at_10(src, dst):
    """A copy of out_dir src as it stood at iter 10: its checkpoints up to 10, its metrics."""
    later = shutil.ignore_patterns("ckpt.pt", "ckpt_best.pt", "ckpt_0000015.pt", "ckpt_0000020.pt")
    shutil.copytree(src, dst, ignore=later)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon_dist")
    data = char_dataset(root / "chars")
    assert run_script("train.py", *args(data, root / "one")).returncode == 0
    on_ranks(2, args(data, root / "ddp2"))
    on_ranks(4, args(data, root / "ddp4"))
    started = time.perf_counter()
    on_ranks(2, args(data, root / "fsdp2", parallelism="fsdp"))
    fsdp_seconds = time.perf_counter() - started
    at_10(root / "one", root / "one_fsdp2")
    on_ranks(2, args(data, root / "one_fsdp2", parallelism="fsdp", init_from="resume"))
    at_10(root / "fsdp2", root / "fsdp2_one")
    assert run_script("train.py", *args(data, root / "fsdp2_one", init_from="resume")).returncode == 0
    return root, data, fsdp_seconds


def final(out_dir):
    return torch.load(out_dir / "ckpt.pt", weights_only=True)


def assert_close_states(a, b, rtol=1e-4, atol=1e-5):
    """Weights and both optimizers' states (every parameter's, whole) within the tolerance."""
    assert a["iter_num"] == b["iter_num"] == 20
    torch.testing.assert_close(a["model"], b["model"], rtol=rtol, atol=atol)  # every key, and only those
    states = [[o["state"] for o in run["optimizer"]["optimizers"]] for run in (a, b)]
    assert all(states[0])  # Muon's and AdamW's, each holding a state
    torch.testing.assert_close(*states, rtol=rtol, atol=atol)


def assert_same_run(a, b):
    """Runs a and b (out_dirs): the same losses and final state, within the tolerances above."""
    assert losses(a) == pytest.approx(losses(b), rel=1e-5, abs=1e-6)
    assert_close_states(final(a), final(b))


def test_the_checkpoint_holds_every_matrixs_momentum_and_the_runs_learn(runs):
    root, _, _ = runs
    assert len(final(root / "one")["optimizer"]["optimizers"][0]["state"]) == 16  # 4 layers x 4 matrices
    evals = [r["val_loss"] for r in read_metrics(root / "ddp4") if "val_loss" in r]
    assert evals[-1] < evals[0] - 0.5


# shared Muon under DDP trains as one process (the checkpoint holds every rank's momenta), FSDP2 as DDP,
# and a resume from iter 10 on 1 -> 2 and 2 -> 1 ranks as the run it left would have gone on
@pytest.mark.parametrize(
    "run, reference",
    [("ddp2", "one"), ("ddp4", "one"), ("fsdp2", "ddp2"), ("one_fsdp2", "fsdp2"), ("fsdp2_one", "one")],
)
def test_a_run_equals_its_reference(runs, run, reference):
    root, _, _ = runs
    assert_same_run(root / run, root / reference)


def test_muon_under_fsdp_killed_at_a_random_moment_resumes_bit_for_bit(runs, tmp_path):
    """SIGKILL to torchrun and its ranks at a random moment of the run, then --init_from=auto: the
    same metrics and the same final checkpoint as fsdp2's, bit for bit."""
    root, data, seconds = runs
    argv = args(data, tmp_path / "killed", parallelism="fsdp", init_from="auto")
    proc = start_python(torchrun(2, "train.py", *argv), log=tmp_path / "killed.log", env=ENV)
    moment = random.uniform(0.3, 0.9) * seconds
    try:
        proc.wait(timeout=moment)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
        proc.wait()
    on_ranks(2, argv)
    assert untimed(tmp_path / "killed") == untimed(root / "fsdp2"), f"killed at {moment:.1f} s"
    assert_close_states(final(tmp_path / "killed"), final(root / "fsdp2"), rtol=0, atol=0)


# tests/muon_rank.py's model: 14 bare matrices of 5 shapes, some with fewer matrices than ranks
SHAPES = [[16, 8, 3], [8, 16, 3], [24, 8, 2], [8, 8, 5], [32, 8, 1]]
OWNERS = assign({(a, b): count for a, b, count in SHAPES}, 4)  # each matrix's rank


@pytest.fixture(scope="module")
def muon_ranks(tmp_path_factory):
    """Each rank's report of tests/muon_rank.py on 4 ranks: 2 steps of Muon shared over them,
    compiled (dynamo's graphs, on the eager backend), then a resume through DCP and a step more."""
    root = tmp_path_factory.mktemp("muon_ranks")
    options = json.dumps({"shapes": SHAPES, "steps": 2, "backend": "eager"})
    result = run_python(torchrun(4, "tests/muon_rank.py", root / "rank", options), env=ENV, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(4)]


def test_each_rank_orthogonalizes_its_share_and_keeps_its_momenta(muon_ranks):
    """Each rank runs the iterations on its own matrices only, every step, and holds only their
    momenta (together the one-process Muon's bytes), in its state_dict too, but rank 0's, the full
    format's writer, which holds every matrix's; the weights are the one-process step's, bit for bit."""
    owned = [sum(ranks.count(r) for ranks in OWNERS.values()) for r in range(4)]
    assert sum(owned) == 14 and 0 < min(owned)
    assert [r["orthogonalized"] for r in muon_ranks] == [[n] * 3 for n in owned]  # 2 steps, 1 after the resume
    assert [r["momenta"] for r in muon_ranks] == owned
    assert sum(r["state_bytes"] for r in muon_ranks) == muon_ranks[0]["alone_state_bytes"]
    assert muon_ranks[0]["state_dict_bytes"] == muon_ranks[0]["alone_state_bytes"] > muon_ranks[0]["state_bytes"]
    assert all(r["state_dict_bytes"] == r["state_bytes"] > 0 for r in muon_ranks[1:])
    assert all(r["gap"] == r["alone_gap"] == 0 for r in muon_ranks)


def test_a_resume_through_dcp_continues_exactly_on_the_graphs_it_had(muon_ranks):
    """DCP's zero steps (the sharded format's resume) compile no graph: one per shape and function,
    apply's for every shape and direction's for those the rank owns a matrix of, beside the
    one-process Muon's fused step, one per shape."""
    for r, report in enumerate(muon_ranks):
        mine = sum(r in ranks for ranks in OWNERS.values())
        assert report["graphs"] == report["graphs_resumed"] == 5 + 5 + mine
        assert report["resumed_gap"] == 0


def test_a_world_size_that_does_not_divide_the_rows_is_one_line(runs, tmp_path):
    root, data, _ = runs
    argv = args(data, tmp_path / "three", parallelism="fsdp", gradient_accumulation_steps=3)
    result = run_python(torchrun(3, "train.py", *argv), env=ENV)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    # one line from each rank (torchrun then reports the failed ranks its own way)
    assert len(errors) == 3 and all("the 3 ranks must divide every matrix's rows" in line for line in errors)
