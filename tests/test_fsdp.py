"""Several processes on CPU (gloo) under torchrun: FSDP2 trains like DDP, saves the same
checkpoint format and resumes exactly, and two torchrun launches rendezvous as two nodes.

Two launches of two processes each, shared by the tests here and by tests/test_checkpoint_format.py
(shared_launches; a process's start is most of a small run's time, so each launch runs several
train.py runs one after the other in the same ranks, see DRIVER):
  first, two torchrun agents (--nnodes=2, c10d rendezvous on localhost), one process each:
    ddp               DDP, 8 steps
    two_node          FSDP, 8 steps
    sharded_straight  test_checkpoint_format's FSDP run, sharded + async checkpoints
  then one standalone launch:
    split             the two-node run's out_dir as it stood at iter 4, resumed to 8
    sharded_split, sharded_full_disk   test_checkpoint_format's resumes (the last one fails)
The runs here also use activation checkpointing, so its composition with DDP and FSDP is under
test too, and have a NaN loss injected at step 5, which all ranks must skip (the gradient norm decides)."""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import textwrap

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, char_dataset, python_process, read_metrics, shared_dir, tiny_args

from model import GPT, GPTConfig

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)

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
# test_checkpoint_format.py's runs (tiny_args and these): FSDP on 2 ranks, sharded + async, 20 steps
# (keep_last=4: iters 5, 10, 15 and 20 stay)
SHARDED = dict(
    max_iters=20,
    lr_decay_iters=20,
    eval_interval=5,
    gradient_accumulation_steps=2,
    dropout=0.1,
    parallelism="fsdp",
    checkpoint_format="sharded",
    async_checkpoint=True,
    keep_last=4,
)

# train.py under torchrun as a user runs it, once for each run in the JSON list argv[2] (name, train.py
# arguments, NaN steps), one after the other in the same ranks. Each run has a process group of its
# own (for each run after the first, a store on the port that the test chose, hosted by rank 0:
# torchrun's own store keeps the previous group's addresses) and a NaN loss at its NaN steps on every
# rank (conftest.train_in_rank). Each rank's stdout, stderr and exit code of each run go to
# root/<name>/rank<r>.*; a run that fails ends the process with its exit code
DRIVER = textwrap.dedent("""
    import json, os, sys
    sys.path[:0] = [{repo!r}, os.path.join({repo!r}, "tests")]
    from conftest import train_in_rank
    root, runs = sys.argv[1], json.loads(sys.argv[2])
    # every rank runs on this machine, the two "nodes" too: they share its cores as a standalone launch's
    # ranks do (runtime.setup gives a rank cpu_count / LOCAL_WORLD_SIZE threads), so a run computes the
    # same under both launches, bit for bit
    os.environ["LOCAL_WORLD_SIZE"] = os.environ["WORLD_SIZE"]

    def run(name, args, nan, port):
        report = os.path.join(root, name, "rank" + os.environ["RANK"])
        code = train_in_rank(report, args, port, nan)
        with open(report + ".json", "w") as f:
            json.dump({{"exit": code}}, f)
        return code

    for spec in runs:
        code = run(**spec)
        if code:
            sys.exit(code)
""")


def torchrun(launch, root, runs, nodes=1):
    """Start `torchrun <launch>` `nodes` times (one agent per node), its ranks running `train.py args`
    for each (name, args, NaN steps) in runs, in that order (DRIVER); returns the Popens."""
    driver = root / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO)))
    for name, *_ in runs:
        (root / name).mkdir(exist_ok=True)
    specs = json.dumps(
        [
            {"name": name, "args": [*map(str, args)], "nan": sorted(nan), "port": i and free_port()}
            for i, (name, args, nan) in enumerate(runs)
        ]
    )
    cmd = ["-m", "torch.distributed.run", *launch, driver, root, specs]
    return [python_process(cmd, env={"OMP_NUM_THREADS": "1"}) for _ in range(nodes)]


def finish(procs, root, runs, timeout=300):
    """Wait for a launch's agents; (their exit codes, their stderr, each run's ranks' reports by name:
    exit, stdout, stderr)."""
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)  # torchrun and its workers
                    q.wait()
            pytest.fail(
                f"torchrun of {[name for name, *_ in runs]} still running after {timeout} s: a rank is waiting for another"
            )
    done = {}
    for name, *_ in runs:
        if not all((root / name / f"rank{r}.json").exists() for r in range(2)):
            break
        done[name] = reports(root, name)
    return [p.returncode for p in procs], "".join(err[-3000:] for _, err in outputs), done


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_launches(root):
    """The runs of the module docstring, under root (shared_launches)."""
    data = char_dataset(root / "chars")
    ours = lambda name, *extra: (
        name,
        [*TRAIN_ARGS, f"--dataset={data}", f"--out_dir={root / name}", *extra],
        {NAN_STEP},
    )
    sharded = lambda name, **overrides: (name, tiny_args(data, root / name, **{**SHARDED, **overrides}), set())
    # two "nodes" of one process each, meeting at a c10d rendezvous as separate machines would
    node = [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=localhost:{free_port()}",
        "--rdzv_id=test-two-nodes",
    ]
    # checkpoints at iters 4 and 8 (eval_interval=4) besides ckpt.pt
    first = [
        ours("ddp", "--parallelism=ddp"),
        ours("two_node", FSDP, "--always_save_checkpoint=True", "--keep_last=2"),
        sharded("sharded_straight"),
    ]
    codes, stderr, reports = finish(torchrun(node, root, first, nodes=2), root, first)
    assert codes == [0, 0], stderr + "".join(r["stderr"][-3000:] for ranks in reports.values() for r in ranks)
    # the two-node run as it stood at iter 4, resumed by a standalone launch
    shutil.copytree(
        root / "two_node",
        root / "split",
        ignore=shutil.ignore_patterns("ckpt.pt", "ckpt_best.pt", "ckpt_0000008.pt", "rank*"),
    )
    # test_checkpoint_format's: iter 10's checkpoint was written in the background while the straight run trained on
    shutil.copytree(
        root / "sharded_straight",
        root / "sharded_split",
        symlinks=True,
        ignore=shutil.ignore_patterns("ckpt_0000015", "ckpt_0000020", "ckpt_best", "rank*"),
    )
    # and the straight run's last checkpoint resumed on 2 ranks, its next write (iter 25) failing with ENOSPC
    shutil.copytree(
        root / "sharded_straight", root / "sharded_full_disk", symlinks=True, ignore=shutil.ignore_patterns("rank*")
    )
    (root / "sharded_full_disk" / "ckpt_0000025").mkdir()
    for rank in range(2):
        os.symlink("/dev/full", root / "sharded_full_disk" / "ckpt_0000025" / f"__{rank}_0.distcp")
    then = [
        ours("split", FSDP, "--init_from=resume"),
        sharded("sharded_split", init_from="resume"),
        sharded("sharded_full_disk", init_from="resume", max_iters=30, lr_decay_iters=30),
    ]
    codes, stderr, reports = finish(torchrun(["--standalone", "--nproc_per_node=2"], root, then), root, then)
    assert len(reports) == 3 and all(r["exit"] == 0 for name in ("split", "sharded_split") for r in reports[name]), (
        stderr + "".join(r["stderr"][-3000:] for ranks in reports.values() for r in ranks)
    )
    (root / "sharded_full_disk" / "launch.json").write_text(json.dumps(codes))


def shared_launches(tmp_path_factory):
    """The launches' root, built once per test run (conftest.shared_dir) for this file and
    tests/test_checkpoint_format.py; read it only."""
    return shared_dir(tmp_path_factory, "fsdp_launches", build_launches)


def reports(root, name):
    """Each rank's report of run `name` (exit, stdout, stderr)."""
    return [
        {
            **json.loads((root / name / f"rank{r}.json").read_text()),
            **{
                key: (root / name / f"rank{r}{suffix}").read_text()
                for key, suffix in (("stdout", ".out"), ("stderr", ".err"))
            },
        }
        for r in range(2)
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = shared_launches(tmp_path_factory)
    return root, [r["stdout"] for r in reports(root, "two_node")]


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
