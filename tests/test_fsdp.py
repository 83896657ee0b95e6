"""Several processes on CPU (gloo) under torchrun: FSDP2 trains like DDP, saves the same
checkpoint format and resumes exactly, and two torchrun launches rendezvous as two nodes.

The runs, shared by the tests, each a torchrun launch of tests/train_rank.py (train.py's main in
each rank, a NaN loss injected; tests/test_checkpoint_format.py launches its sharded runs the same way):
  ddp       DDP, 8 steps
  two_node  FSDP, 8 steps, by two torchrun agents (--nnodes=2, c10d rendezvous on localhost) of one rank each
  split     the two-node run's out_dir as it stood at iter 4, resumed to 8
The runs here also use activation checkpointing, so its composition with DDP and FSDP is under
test too, and have a NaN loss injected at step 5, which all ranks must skip (the gradient norm decides)."""

import json
import math
import os
import shutil
import signal
import socket
import subprocess

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, char_dataset, read_metrics, start_python

from model import GPT, GPTConfig

pytestmark = [
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
    pytest.mark.process,  # every test here reads the torchrun launches
]

TRAIN_ARGS = [
    "config/train_llama_tiny.py",
    "--block_size=32",
    "--batch_size=4",
    "--gradient_accumulation_steps=4",
    "--max_iters=8",
    "--lr_decay_iters=8",
    "--warmup_iters=2",
    "--eval_interval=4",
    "--eval_iters=2",
    "--log_interval=1",
    "--dropout=0.1",  # so each rank's RNG stream must be the same under both, and restored on resume
    "--activation_checkpointing=True",  # under DDP and FSDP alike
    "--checkpoint_format=full",  # FSDP's default is sharded (test_checkpoint_format.py); this is the one-file format
]
FSDP = "--parallelism=fsdp"
NAN_STEP = 5


def torchrun(root, name, args, nan=(), nodes=False, timeout=300):
    """train.py ARGS on 2 ranks as run `name` (tests/train_rank.py, its reports in root/name), a NaN
    loss at the steps `nan` on every rank: one standalone torchrun launch, or with nodes=True two
    agents of one rank each meeting at a c10d rendezvous as two machines would. Killed, with the test
    failing, past `timeout` (a rank waiting for ever). Returns (the agents' exit codes, their stderr,
    the ranks' reports: exit, stdout, stderr)."""
    (root / name).mkdir(exist_ok=True)  # a resume's: a copy of another run's
    options = {"nan_at": sorted(nan)}
    launch = ["--standalone", "--nproc_per_node=2"]
    if nodes:
        rendezvous = f"--rdzv_endpoint=localhost:{free_port()}"
        launch = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", rendezvous, f"--rdzv_id={name}"]
        # both ranks run on this machine, sharing its cores as a standalone launch's do (runtime.setup gives a
        # rank cpu_count / LOCAL_WORLD_SIZE threads), so a run computes the same under both launches, bit for bit
        options["local_world_size"] = 2
    driver = [REPO / "tests" / "train_rank.py", root / name / "rank", json.dumps(options)]
    cmd = ["-m", "torch.distributed.run", *launch, *driver, *map(str, args)]
    procs = [start_python(cmd, env={"OMP_NUM_THREADS": "1"}) for _ in range(2 if nodes else 1)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)  # torchrun and its ranks
                    q.communicate()
            pytest.fail(f"torchrun of {name} still running after {timeout} s: a rank is waiting for another")
    return [p.returncode for p in procs], "".join(err[-3000:] for _, err in outputs), reports(root, name)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def succeeded(launch):
    codes, stderr, ranks = launch
    assert codes == [0] * len(codes), stderr + "".join(r["stderr"][-3000:] for r in ranks)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs of the module docstring: their root, and the two-node run's ranks' stdout."""
    root = tmp_path_factory.mktemp("fsdp")
    data = char_dataset(root / "chars")
    ours = lambda name, *extra, nodes=False: torchrun(
        root, name, [*TRAIN_ARGS, f"--dataset={data}", f"--out_dir={root / name}", *extra], {NAN_STEP}, nodes
    )
    succeeded(ours("ddp", "--parallelism=ddp"))
    # checkpoints at iters 4 and 8 (eval_interval=4) besides ckpt.pt
    succeeded(ours("two_node", FSDP, "--always_save_checkpoint=True", "--keep_last=2", nodes=True))
    # the two-node run as it stood at iter 4, resumed by a standalone launch
    at_4 = shutil.ignore_patterns("ckpt.pt", "ckpt_best.pt", "ckpt_0000008.pt", "rank*")
    shutil.copytree(root / "two_node", root / "split", ignore=at_4)
    succeeded(ours("split", FSDP, "--init_from=resume"))
    return root, [r["stdout"] for r in reports(root, "two_node")]


def reports(root, name):
    """Each rank's report of run `name` (exit, stdout, stderr); exit None: the rank wrote none."""
    read = lambda path: path.read_text() if path.exists() else ""
    return [
        {
            "exit": json.loads(read(root / name / f"rank{r}.json") or "{}").get("exit"),
            "stdout": read(root / name / f"rank{r}.out"),
            "stderr": read(root / name / f"rank{r}.err"),
        }
        for r in range(2)
    ]


def losses(out_dir):
    """Every logged loss in order, training steps and evaluations, and the poisoned step's."""
    records = read_metrics(out_dir)
    poisoned = [r["loss"] for r in records if r["iter"] == NAN_STEP and "loss" in r]
    return [
        r[k] for r in records if r["iter"] != NAN_STEP for k in ("loss", "train_loss", "val_loss") if k in r
    ], poisoned


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
    untimed = lambda records: [
        json.dumps({k: v for k, v in r.items() if k not in ("dt_ms", "tokens_per_s")}) for r in records
    ]
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
