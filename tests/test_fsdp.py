"""Several processes on CPU (gloo) under torchrun: FSDP2 trains like DDP, saves the same
checkpoint format and resumes exactly, and two torchrun launches rendezvous as two nodes.

Three launches of two processes each, shared by the tests (torchrun's start-up is most of the time):
  ddp       standalone, DDP, 8 steps
  two_node  two torchrun agents (--nnodes=2, c10d rendezvous on localhost), FSDP, 8 steps
  split     the two-node run's out_dir as it stood at iter 4, resumed to 8 by a standalone launch
Every run also uses activation checkpointing, so its composition with DDP and FSDP is under test
too, and has a NaN loss injected at step 5, which all ranks must skip (the gradient norm decides)."""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, load_script, make_text, read_metrics

from model import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

TRAIN_ARGS = [
    "config/train_llama_tiny.py", "--block_size=32", "--batch_size=4", "--gradient_accumulation_steps=4",
    "--max_iters=8", "--lr_decay_iters=8", "--warmup_iters=2", "--eval_interval=4", "--eval_iters=2", "--log_interval=1",
    "--dropout=0.1",  # so each rank's RNG stream must be the same under both, and restored on resume
    "--activation_checkpointing=True",  # under DDP and FSDP alike
    "--checkpoint_format=full",  # FSDP's default is sharded (test_checkpoint_format.py); this is the one-file format
]
FSDP = "--parallelism=fsdp"
NAN_STEP = 5

# train.py under torchrun, with a NaN loss at step NAN_STEP on every rank (conftest.nan_steps)
DRIVER = textwrap.dedent("""
    import os, runpy, sys
    sys.path[:0] = [{repo!r}, os.path.join({repo!r}, "tests")]
    from conftest import nan_steps
    nan_steps(setattr, {{{step}}})
    sys.argv[0] = "train.py"
    runpy.run_path("train.py", run_name="__main__")
""")


def torchrun(launch, out_dir, data_dir, *extra):
    """Start `torchrun <launch> train.py ...` (by the driver beside out_dir); returns the Popen."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, str(out_dir.parent / "driver.py"), *TRAIN_ARGS,
           f"--dataset={data_dir}", f"--out_dir={out_dir}", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(*procs):
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    return [out for out, _ in outputs]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    (root / "driver.py").write_text(DRIVER.format(repo=str(REPO), step=NAN_STEP))
    data = root / "chars"
    data.mkdir()
    load_script("data/shakespeare_char/prepare.py").prepare(make_text(), str(data))
    standalone = ["--standalone", "--nproc_per_node=2"]
    finish(torchrun(standalone, root / "ddp", data, "--parallelism=ddp"))
    # two "nodes" of one process each, meeting at a c10d rendezvous as separate machines would
    node = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{free_port()}",
            "--rdzv_id=test-two-nodes"]
    # checkpoints at iters 4 and 8 (eval_interval=4) besides ckpt.pt
    stdouts = finish(*(torchrun(node, root / "two_node", data, FSDP, "--always_save_checkpoint=True", "--keep_last=2")
                       for _ in range(2)))
    # the two-node run as it stood at iter 4, resumed by a standalone launch
    shutil.copytree(root / "two_node", root / "split", ignore=shutil.ignore_patterns("ckpt.pt", "ckpt_best.pt", "ckpt_0000008.pt"))
    finish(torchrun(standalone, root / "split", data, FSDP, "--init_from=resume"))
    return root, stdouts


def losses(out_dir):
    """Every logged loss in order, training steps and evaluations, and the poisoned step's."""
    records = read_metrics(out_dir)
    poisoned = [r["loss"] for r in records if r["iter"] == NAN_STEP and "loss" in r]
    return [r[k] for r in records if r["iter"] != NAN_STEP for k in ("loss", "train_loss", "val_loss") if k in r], poisoned


def test_fsdp_trains_like_ddp(runs):
    root, _ = runs
    (ddp, ddp_nan), (fsdp, fsdp_nan) = losses(root / "ddp"), losses(root / "two_node")
    assert len(ddp) == len(fsdp) == 7 + 3 * 2
    # the same model, data and dropout streams: only the order of float additions in the gradient
    # reductions differs (all-reduce against reduce-scatter)
    assert fsdp == pytest.approx(ddp, rel=1e-5, abs=1e-6)
    assert ddp[-1] < ddp[1] - 0.3  # and both learned
    # the NaN step was skipped on every rank (a rank stepping alone would make the losses differ)
    assert math.isnan(ddp_nan[0]) and math.isnan(fsdp_nan[0])


def test_fsdp_checkpoint_has_the_one_format_and_resumes_exactly(runs):
    root, _ = runs
    straight, split = read_metrics(root / "two_node"), read_metrics(root / "split")
    # as JSON text, so the NaN of the poisoned step compares equal to itself
    untimed = lambda records: [json.dumps({k: v for k, v in r.items() if k not in ("dt_ms", "tokens_per_s")})
                               for r in records]
    assert untimed(split) == untimed(straight)  # every loss and eval bit for bit, no step lost or repeated
    a, b, ddp = (torch.load(root / d / "ckpt.pt", weights_only=True) for d in ("two_node", "split", "ddp"))
    assert a["iter_num"] == b["iter_num"] == 8
    assert a["model"].keys() == b["model"].keys() == ddp["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for k, v in a["optimizer"]["state"].items():
        assert all(torch.equal(v[s], b["optimizer"]["state"][k][s]) for s in v)
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
