"""torchrun on CPU (gloo): FSDP2 trains like DDP, saves the same checkpoint format and resumes
exactly, and two torchrun launches rendezvous as two nodes. The shared runs (tests/train_rank.py; ddp
in split's launch, after it), with dropout, activation checkpointing and a NaN loss at step 5 that
every rank must skip:
  ddp       DDP, 8 steps
  two_node  FSDP, 8 steps, by two agents of one rank each (--nnodes=2, c10d rendezvous on localhost)
  split     the two-node run's out_dir as it stood at iter 4, resumed to 8"""

import json
import math
import os
import shutil

import pytest
import torch
from conftest import assert_same_run, char_dataset, losses, read_metrics
from processes import TORCHRUN_ARGS, needs_gloo, succeeded, torchrun

from model import GPT, GPTConfig

pytestmark = [needs_gloo, pytest.mark.process]  # every test here reads the torchrun launches

DROPOUT_ARGS = [
    *TORCHRUN_ARGS,
    "--eval_iters=2",
    "--dropout=0.1",  # so each rank's RNG stream must be the same under both, and restored on resume
    "--activation_checkpointing=True",  # under DDP and FSDP alike
    "--checkpoint_format=full",  # FSDP's default is sharded (test_checkpoint_format.py); this is the one-file format
]
FSDP = "--parallelism=fsdp"
NAN_STEP = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module docstring's runs: their root, and the two-node run's ranks' stdout."""
    root = tmp_path_factory.mktemp("fsdp")
    data = char_dataset(root / "chars")
    args = lambda name, *extra: [*DROPOUT_ARGS, f"--dataset={data}", f"--out_dir={root / name}", *extra]
    options = {"nan_at": [NAN_STEP]}
    # checkpoints at iters 4 and 8 (eval_interval=4) besides ckpt.pt
    keep = ["--always_save_checkpoint=True", "--keep_last=2"]
    two_node = succeeded(torchrun(root, "two_node", args("two_node", FSDP, *keep), options, nodes=True))
    # the two-node run as it stood at iter 4, resumed by a standalone launch, which then runs ddp
    at_4 = shutil.ignore_patterns("ckpt.pt", "ckpt_best.pt", "ckpt_0000008.pt", "rank*")
    shutil.copytree(root / "two_node", root / "split", ignore=at_4)
    ddp = [str(root / "ddp" / "rank"), options, args("ddp", "--parallelism=ddp")]
    succeeded(torchrun(root, "split", args("split", FSDP, "--init_from=resume"), {**options, "then": [ddp]}))
    return root, [r["stdout"] for r in two_node]


def test_fsdp_trains_like_ddp(runs):
    root, _ = runs
    ddp, fsdp = losses(root / "ddp"), losses(root / "two_node")
    assert len(ddp) == len(fsdp) == 8 + 3 * 2
    # the same model, data and dropout streams: only the order of float additions in the gradient
    # reductions differs (all-reduce against reduce-scatter); the poisoned step's NaN stands in both
    assert fsdp == pytest.approx(ddp, rel=1e-5, abs=1e-6, nan_ok=True)
    assert ddp[-1] < ddp[1] - 0.3  # and both learned
    # the NaN step was skipped on every rank (a rank stepping alone would make the losses differ)
    poisoned = lambda run: [r["loss"] for r in read_metrics(root / run) if r["iter"] == NAN_STEP and "loss" in r]
    assert math.isnan(*poisoned("ddp")) and math.isnan(*poisoned("two_node"))


def test_fsdp_checkpoint_has_the_one_format_and_resumes_exactly(runs):
    root, _ = runs
    assert_same_run(root / "split", root / "two_node")  # every loss and eval, weight and moment, bit for bit
    a, ddp = (torch.load(root / d / "ckpt.pt", weights_only=True) for d in ("two_node", "ddp"))
    assert a["iter_num"] == 8 and a["model"].keys() == ddp["model"].keys()
    # the FSDP checkpoint is whole and plain: a single-process model and optimizer load it as they
    # load a DDP one (sample.py, nanoGPT's scripts, a resume under DDP)
    model = GPT(GPTConfig(**a["model_args"]))
    model.load_state_dict(a["model"])
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    optimizer.load_state_dict(a["optimizer"])
    assert a["optimizer"]["param_groups"][0]["params"] == ddp["optimizer"]["param_groups"][0]["params"]
    shapes = lambda optimizer_state: {k: v.shape for k, v in optimizer_state["state"][0].items()}
    assert shapes(a["optimizer"]) == shapes(ddp["optimizer"])


def test_two_nodes_train_together(runs):
    root, stdouts = runs
    # one process per node, and only global rank 0 (on whichever node) reports and writes
    assert sum("2 rank(s) x 2 micro-steps" in out for out in stdouts) == 1
    files = os.listdir(root / "two_node")
    assert "ckpt.pt" in files and not any(f.endswith(".tmp") for f in files)
    state = torch.load(root / "two_node" / "ckpt.pt", weights_only=True)
    assert len(state["rng"]["torch"]) == 2  # both ranks' dropout streams were gathered into it
    assert json.loads((root / "two_node" / "config.json").read_text())["parallelism"] == "fsdp"
