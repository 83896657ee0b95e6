"""Muon shared out across ranks on CPU processes over gloo under torchrun: under DDP each rank
orthogonalizes its share of the matrices and keeps only their momenta, under FSDP2 each matrix's rows
go to one rank and back. Both train as one process does, compiled too, and resume on any world size
from either checkpoint format, a rank that owns no matrix of a shape included (docs/distributed.md).

The runs (RUNS): train.py on config/train_llama_1b.py at tiny shapes (GQA, SwiGLU; 1 layer: 4 matrices
of 4 shapes, so on 4 ranks each owns none of three shapes, on 2 none of two), Muon, 6 steps, a
checkpoint every 2; 1 rank in pytest's process, 2 or 4 under one torchrun of tests/train_rank.py (the
compiled runs compile the model and Muon on aot_eager). gradient_accumulation_steps counts all ranks'
micro-steps, so 4 is one global batch on 1, 2 or 4 ranks, and a checkpoint carries the data position: a
run on any world size, or resumed on another, takes one process's batches and only adds the micro-steps'
gradients in another order (in one process, or by gloo's reductions), so it is held to one process's
run within rel 1e-5, abs 1e-6 on the losses, rel 1e-4, abs 1e-5 on weights and momenta (Newton-Schulz
spreads a gradient's last bit). A resume on the world size it left adds in the same order: exactly, but
DDP over 4 ranks, whose first step all-reduces in DDP's first bucket layout, the straight run's in the
rebuilt one, and gloo's ring adds 4 ranks' gradients in another order (1 ulp).
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
from conftest import assert_same_run, char_dataset, losses, read_metrics, tiny_args, untimed
from processes import needs_gloo, run_python, run_script, start_python

from gpt.train.muon import assign

# every test here reads torchrun launches
pytestmark = [needs_gloo, pytest.mark.process]

LLAMA = dict(n_layer=1, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64, dtype="float32", batch_size=2)
RUN = dict(gradient_accumulation_steps=4, max_iters=6, lr_decay_iters=6, eval_interval=2, eval_iters=1)
# AdamW's learning_rate at twice tiny_args': the val loss falls by 0.70 in 6 steps (0.48 at 1e-2)
RUN.update(learning_rate=2e-2, always_save_checkpoint=True, keep_last=3, optimizer="muon", muon_weight_decay=0.01)
LOGGED = 6 + 2 * 4  # the losses of 6 steps and of 4 evals (at 0, 2, 4, 6), train and val
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
COMPILED, FSDP = dict(compile=True), dict(parallelism="fsdp")
# {run: (ranks, the format it writes, (the run it resumes, at iter) or None, its other settings)}
RUNS = {
    "one": (1, "full", None, {}),
    "ddp2": (2, "full", None, COMPILED),
    "fsdp2": (2, "full", None, {**COMPILED, **FSDP}),
    "one_fsdp2": (2, "full", ("one", 2), FSDP),  # 1 -> 2 ranks, FSDP2
    "fsdp2_one": (1, "full", ("fsdp2", 2), {}),  # 2 -> 1, from FSDP2
    "ddp4": (4, "sharded", None, {}),
    "ddp4_4": (4, "full", ("ddp4", 2), {}),  # 4 -> 4, sharded
    "ddp4_2": (2, "full", ("ddp4", 2), {}),  # 4 -> 2, sharded
    "ddp4_4_2": (2, "full", ("ddp4_4", 4), {}),  # 4 -> 2, full
    "one_2": (2, "sharded", ("one", 2), {}),  # 1 -> 2, full
    "ddp4_1": (1, "sharded", ("ddp4", 2), {}),  # 4 -> 1, sharded
    "ddp4_1_2": (2, "full", ("ddp4_1", 4), {}),  # 1 -> 2, sharded
    "ddp4_2_1": (1, "full", ("ddp4_2", 4), {}),  # 2 -> 1, full
    "one_2_1": (1, "full", ("one_2", 4), {}),  # 2 -> 1, sharded
    "ddp4_2_2": (2, "full", ("ddp4_2", 4), {}),  # 2 -> 2, full: exact
    "one_2_2": (2, "full", ("one_2", 4), {}),  # 2 -> 2, sharded: exact
    "fsdp4": (4, "sharded", None, FSDP),
    "fsdp4_4": (4, "sharded", ("fsdp4", 2), FSDP),  # 4 -> 4, sharded: exact
}


def args(data, out, **overrides):
    return ["config/train_llama_1b.py", *tiny_args(data, out, **{**LLAMA, **RUN, **overrides})]


def launch(nproc, *argv):
    """python's arguments for argv (a script and its arguments) under a standalone torchrun of nproc CPU ranks."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv]


def train(nproc, out, argv, compiled=False):
    """train.py argv on nproc ranks (1: in this process, else tests/train_rank.py's under one torchrun); rank 0's stdout."""
    if nproc == 1:
        result = run_script("train.py", *argv)
    else:
        out.mkdir(exist_ok=True)
        options = json.dumps({"backend": "aot_eager"} if compiled else {})
        result = run_python(launch(nproc, "tests/train_rank.py", out / "rank", options, *argv), env=ENV, timeout=240)
    err = out / "rank0.err"
    assert result.returncode == 0, (result.stderr + (err.read_text() if nproc > 1 and err.exists() else ""))[-3000:]
    return result.stdout if nproc == 1 else (out / "rank0.out").read_text()


def copy_at(src, dst, iter_num):
    """A copy of out_dir src as it stood at iter_num: its checkpoints up to it (either format), its metrics."""
    later = [f"ckpt_{i:07d}{ext}" for i in range(iter_num + 1, 7) for ext in ("", ".pt")]
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ckpt.pt", "ckpt_best*", "rank*", *later))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(name): RUNS' run (after those it resumes), once: (its out_dir, rank 0's stdout, its seconds)."""
    root = tmp_path_factory.mktemp("muon_dist")
    data, done = char_dataset(root / "chars"), {}

    def run(name):
        if name not in done:
            nproc, writes, source, settings = RUNS[name]
            if source:
                copy_at(run(source[0])[0], root / name, source[1])
                settings = {**settings, "init_from": "resume"}
            started = time.perf_counter()
            argv = args(data, root / name, checkpoint_format=writes, **settings)
            stdout = train(nproc, root / name, argv, compiled=settings.get("compile", False))
            assert not source or f"resuming at iter {source[1]}" in stdout
            done[name] = root / name, stdout, time.perf_counter() - started
        return done[name]

    return run


def final(out_dir):
    return torch.load(out_dir / "ckpt.pt", weights_only=True)


def test_the_checkpoint_holds_every_matrixs_momentum_and_the_compiled_runs_learn_as_eager(run):
    """The compiled runs against one process's eager run: a compiled graph may only add in another
    order, so they stay within the DDP tests' 2e-5 on float32 losses (tests/test_dist.py says why)."""
    one = run("one")[0]
    assert len(final(one)["optimizer"]["optimizers"][0]["state"]) == 4  # 1 layer x 4 matrices
    for name in ("ddp2", "fsdp2"):
        eager, compiled = losses(one), losses(run(name)[0])
        assert len(compiled) == len(eager) == LOGGED and max(abs(a - b) for a, b in zip(eager, compiled)) < 2e-5, name
        evals = [r["val_loss"] for r in read_metrics(run(name)[0]) if "val_loss" in r]
        assert evals[-1] < evals[0] - 0.5, name


# shared Muon under DDP trains as one process on 2 and 4 ranks (the full checkpoint holds every rank's
# momenta), FSDP2 as DDP, and a resume on another world size from either format as one process
REFERENCES = [("ddp2", "one"), ("fsdp2", "ddp2"), ("one_fsdp2", "fsdp2"), ("fsdp2_one", "one")]
WORLD_SIZES = ["ddp4", "ddp4_4", "ddp4_2", "ddp4_4_2", "one_2", "ddp4_1", "ddp4_1_2", "ddp4_2_1", "one_2_1"]
REFERENCES += [(name, "one") for name in WORLD_SIZES]


@pytest.mark.parametrize("name, reference", REFERENCES)
def test_a_run_equals_its_reference(run, name, reference):
    (out, stdout, _), ref = run(name), run(reference)[0]
    assert losses(out) == pytest.approx(losses(ref), rel=1e-5, abs=1e-6) and len(losses(out)) == LOGGED
    nproc, writes, source, _ = RUNS[name]
    if source and RUNS[source[0]][0] != nproc:  # train.py's note on a resume on another world size
        assert f"checkpoint was written by {RUNS[source[0]][0]} rank(s), this run has {nproc}" in stdout
    if writes == "full":
        a, b = final(out), final(ref)
        assert a["iter_num"] == b["iter_num"] == 6
        torch.testing.assert_close(a["model"], b["model"], rtol=1e-4, atol=1e-5)  # every key, and only those
        states = [[o["state"] for o in s["optimizer"]["optimizers"]] for s in (a, b)]
        assert all(states[0])  # Muon's and AdamW's, each holding a state
        torch.testing.assert_close(*states, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_4_ranks_owning_no_matrix_resume_from_the_sharded_format(run, parallelism):
    straight, again = run(f"{parallelism}4")[0], run(f"{parallelism}4_4")[0]
    assert len(losses(straight)) == LOGGED
    if parallelism == "fsdp":
        assert losses(again) == losses(straight)
    else:
        assert losses(again) == pytest.approx(losses(straight), rel=1e-5, abs=1e-6)


def test_a_ddp_rank_owning_no_matrix_resumes_exactly_from_either_format(run):
    """2 ranks resumed on 2 from the full format and from the sharded one: every record carried over and
    logged after the resume (and from the full format the final checkpoint) exactly the run's they left."""
    assert_same_run(run("ddp4_2_2")[0], run("ddp4_2")[0])
    assert untimed(run("one_2_2")[0]) == untimed(run("one_2")[0])


def test_muon_under_fsdp_killed_at_a_random_moment_resumes_bit_for_bit(run, tmp_path):
    """one_fsdp2's run again, with SIGKILL to torchrun and its ranks at a random moment of it, then
    --init_from=auto: the same metrics and the same final checkpoint as one_fsdp2's, bit for bit."""
    (reference, _, seconds), one = run("one_fsdp2"), run("one")[0]
    copy_at(one, tmp_path / "killed", 2)
    argv = args(one.parent / "chars", tmp_path / "killed", checkpoint_format="full", **FSDP, init_from="auto")
    proc = start_python(launch(2, "train.py", *argv), log=tmp_path / "killed.log", env=ENV)
    moment = random.uniform(0.3, 0.9) * seconds
    try:
        proc.wait(timeout=moment)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
        proc.wait()
    train(2, tmp_path / "killed", argv)
    assert untimed(tmp_path / "killed") == untimed(reference), f"killed at {moment:.1f} s"
    assert_same_run(tmp_path / "killed", reference)  # and the final checkpoint, bit for bit


# tests/muon_rank.py's model: 14 bare matrices of 5 shapes, some with fewer matrices than ranks
SHAPES = [[16, 8, 3], [8, 16, 3], [24, 8, 2], [8, 8, 5], [32, 8, 1]]
OWNERS = assign({(a, b): count for a, b, count in SHAPES}, 4)  # each matrix's rank


@pytest.fixture(scope="module")
def muon_ranks(tmp_path_factory):
    """Each rank's report of tests/muon_rank.py on 4 ranks: 2 steps of Muon shared over them,
    compiled (dynamo's graphs, on the eager backend), then a resume through DCP and a step more."""
    root = tmp_path_factory.mktemp("muon_ranks")
    options = json.dumps({"shapes": SHAPES, "steps": 2, "backend": "eager"})
    result = run_python(launch(4, "tests/muon_rank.py", root / "rank", options), env=ENV, timeout=240)
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


def test_a_world_size_that_does_not_divide_the_rows_is_one_line(run, tmp_path):
    argv = args(run("one")[0].parent / "chars", tmp_path / "three", **FSDP, gradient_accumulation_steps=3)
    result = run_python(launch(3, "train.py", *argv), env=ENV)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    # one line from each rank (torchrun then reports the failed ranks its own way)
    assert len(errors) == 3 and all("the 3 ranks must divide every matrix's rows" in line for line in errors)
