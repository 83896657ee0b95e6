"""Shared test helpers: tiny datasets made on the spot, train.py's flags for a tiny model, the
commands run as a user runs them (run_script: main(argv) in this process; start_python and
run_python: a real interpreter; torchrun: two ranks), what tests read of a run (untimed, losses,
one_line_error, wait_for), a checkpoint as train.py writes one, and the chat demo that several
test files read."""

import dataclasses
import fcntl
import functools
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configurator import run_main

# torch.compile's backend for tests about graphs rather than kernels: dynamo's graphs, AOTAutograd's
# forward and backward (the partitioner's split) and inductor's decompositions, run by ATen's kernels.
# Inductor on a CPU builds each fused kernel with g++, about 1 s apiece with a cold cache (as in CI).
ATEN_BACKEND = "aot_eager_decomp_partition"
GPT2 = {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}  # tokenizer.describe of GPT-2's BPE


def load_script(relpath):
    """Import a script that lives outside a package (train.py, data/<name>/prepare.py) as a module."""
    spec = importlib.util.spec_from_file_location(Path(relpath).stem, REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs(*packages):
    """For a test (or, called at a test file's top, the whole file) that uses these packages: where one
    is missing, the test fails saying how to install it if the requirement files name it for this
    machine (make test installs them all), and skips if it is optional."""
    from packaging.requirements import Requirement

    for package in packages:
        try:
            importlib.metadata.distribution(package)  # installed, by its name on PyPI
            continue
        except importlib.metadata.PackageNotFoundError:
            pass
        for path in sorted(REPO.glob("requirements*.txt")):
            lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
            for wanted in map(Requirement, filter(None, lines)):
                if wanted.name == package and (wanted.marker is None or wanted.marker.evaluate()):
                    install = f"pip install -r {path.name} (make test installs every requirement file)"
                    pytest.fail(f"{package} is not installed, and the tests need it: {install}", pytrace=False)
        pytest.skip(f"{package} is not installed (optional here)", allow_module_level=True)


@pytest.fixture
def aten_compile(monkeypatch):
    """torch.compile (training_setup.build's, Muon's) with ATEN_BACKEND, dynamo's caches and counters
    fresh before and after; yields the counters."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=ATEN_BACKEND))
    yield counters
    torch._dynamo.reset()


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
    return char_dataset(tmp_path / "chars")


def char_dataset(data_dir):
    """data_dir, made if it is not there, holding make_text() prepared as a character-level dataset."""
    data_dir.mkdir(parents=True, exist_ok=True)
    load_script("data/shakespeare_char/prepare.py").prepare(make_text(), str(data_dir))
    return data_dir


EVAL_WORDS = "the man picks up a ball and throws it to his dog who runs across the green field café naïve".split()


def write_hellaswag(path, n, seed=0):
    """n records in HellaSwag's official format (the fields eval.py ignores included), every 7th long."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            ctx = " ".join(rng.choice(EVAL_WORDS, size=60 if i % 7 == 0 else rng.integers(4, 12)))
            endings = [" ".join(rng.choice(EVAL_WORDS, size=rng.integers(1, 7))) + "." for _ in range(4)]
            record = dict(ind=i, activity_label="Playing fetch", ctx_a=ctx, ctx_b="", ctx=ctx, split="val")
            record.update(split_type="indomain", label=int(rng.integers(4)), endings=endings, source_id=f"test~{i}")
            f.write(json.dumps(record) + "\n")
    return path


def bpe_eval_data(root):
    """(root/data, root/hs.jsonl): a GPT-2 BPE dataset (train, val, test) and a HellaSwag-format file
    of 30 records, for eval.py's tasks."""
    from gpt import tokenizer, tokens

    enc = tokenizer.encoding("gpt2")
    rng = np.random.default_rng(1)
    data_dir = root / "data"
    data_dir.mkdir()
    for split, n_docs in (("train", 400), ("val", 40), ("test", 40)):
        docs = [" ".join(rng.choice(EVAL_WORDS, size=rng.integers(5, 30))).capitalize() + "." for _ in range(n_docs)]
        ids = [t for d in docs for t in [enc.eot_token] + enc.encode_ordinary(d)]
        tokens.write(str(data_dir / f"{split}.bin"), np.array(ids, dtype=np.uint16))
    (data_dir / "meta.json").write_text(json.dumps(GPT2))
    return data_dir, write_hellaswag(root / "hs.jsonl", 30, seed=2)


def tiny_args(data_dir, out_dir, **overrides):
    """train.py flags for a model that trains in seconds, on the CPU whatever the machine has."""
    args = dict(device="cpu", compile=False, dataset=data_dir, out_dir=out_dir, n_layer=2, n_head=2, n_embd=32)
    args.update(block_size=16, batch_size=4, gradient_accumulation_steps=1, dropout=0.0, learning_rate=1e-2)
    args.update(min_lr=1e-3, max_iters=20, lr_decay_iters=20, warmup_iters=2, eval_interval=10, eval_iters=2)
    args.update(log_interval=1)
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


# bench.py's keys for a model it measures in a second, on the CPU whatever the machine has
TINY_BENCH = dict(device="cpu", compile=False, n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=2)
TINY_BENCH.update(gradient_accumulation_steps=1, bench_iters=2, bench_warmup=1)


def tiny_bench_args(**overrides):
    """bench.py flags for TINY_BENCH's model, with `overrides`."""
    return [f"--{k}={v}" for k, v in {**TINY_BENCH, **overrides}.items()]


def train_tiny_run(root, **overrides):
    """root/out: a tiny character model trained on root/chars for a few steps (block_size 16)."""
    result = run_script("train.py", *tiny_args(char_dataset(root / "chars"), root / "out", **overrides))
    assert result.returncode == 0, result.stderr
    return root / "out"


def read_metrics(out_dir):
    """The records of out_dir/metrics.jsonl, in order."""
    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def untimed(out_dir):
    """out_dir's metrics.jsonl without its timings (dt_ms, tokens_per_s, mfu): two runs that computed
    the same give equal lists. Each record as JSON text, so that a NaN loss equals itself."""
    timings = ("dt_ms", "tokens_per_s", "mfu")
    return [json.dumps({k: v for k, v in r.items() if k not in timings}) for r in read_metrics(out_dir)]


def losses(out_dir):
    """Every loss out_dir's metrics.jsonl logged, in order: training steps, then the evals' train and val losses."""
    return [r[k] for r in read_metrics(out_dir) for k in ("loss", "train_loss", "val_loss") if k in r]


def save_checkpoint(out_dir, model, tokenizer_spec):
    """out_dir (made here) holding model's ckpt.pt as train.py writes one (the model, its args, the
    tokenizer's description), at iter 0 with no config, for the exporters and chat.py to read."""
    import torch

    out_dir.mkdir()
    state = {"model": model.state_dict(), "model_args": dataclasses.asdict(model.config), "config": {}}
    state.update(iter_num=0, best_val_loss=math.nan, tokenizer=tokenizer_spec)
    torch.save(state, out_dir / "ckpt.pt")
    return out_dir


def one_line_error(result, *fragments):
    """The one line a command printed for bad input (result: run_script's or run_python's), once it
    is checked: a non-zero exit (2: configurator.UserError's), no traceback, that line alone on
    stderr, as `error: ...`, holding each fragment."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert all(fragment in lines[0] for fragment in fragments), (lines[0], fragments)
    return lines[0]


def run_script(script, *args, cwd=REPO, env=None, isolated=False):
    """`python SCRIPT ARGS...` as a CompletedProcess. By default the script's main(argv), called in this
    process (a new interpreter's imports, torch's 2-3 CPU-s, are most of a small run's cost) and ended
    as configurator.run_main ends it, with what reaches file descriptors 1 and 2 (C++'s output too)
    captured. isolated=True runs it as a process of its own, for what needs one: settings read at
    import (HF_HUB_OFFLINE), the interpreter's own start."""
    args = [*map(str, args)]
    if isolated:
        return run_python([REPO / script, *args], env=env)
    module = load_script(script)  # loaded afresh: it takes what a test patched, as a new process would
    saved_cwd, saved_env, saved_streams = os.getcwd(), dict(os.environ), (sys.stdout, sys.stderr)
    saved_fds, saved_module = (os.dup(1), os.dup(2)), sys.modules.get(module.__name__)
    # pickle finds a class by its module's name (serve.py sends its config to its model's process)
    sys.modules[module.__name__] = module
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        # write_through: Python's writes and C++'s land in the files in the order they happen
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", write_through=True) for fd in (1, 2)
        )
        os.environ.update(env or {})
        os.chdir(cwd)
        try:
            run_main(functools.partial(module.main, args))
        except SystemExit as e:  # how run_main always ends; sys.exit("message") prints it and exits 1
            code = e.code or 0
            if isinstance(code, str):
                print(code, file=sys.stderr)
                code = 1
        except BaseException:  # what an uncaught exception does to a real process
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, saved in zip((1, 2), saved_fds):
                os.dup2(saved, fd)
                os.close(saved)
            sys.stdout, sys.stderr = saved_streams
            sys.modules.pop(module.__name__)
            if saved_module:
                sys.modules[module.__name__] = saved_module
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode("utf-8", errors="replace") for f in (out, err))
    return subprocess.CompletedProcess([sys.executable, script, *args], code, stdout, stderr)


_STARTED = []


def start_python(args, log=None, env=None):
    """subprocess.Popen([sys.executable, *args]) in the repo root, as text, in a session of its own so
    that os.killpg(proc.pid, ...) reaches what it starts (torchrun's ranks). Its stdout and stderr go to
    pipes, or both to the file `log` (proc.log) for a process nobody reads while it runs (a full pipe
    stops it)."""
    with open(log, "w") if log else nullcontext() as f:
        proc = subprocess.Popen(
            [sys.executable, *map(str, args)],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=f or subprocess.PIPE,
            stderr=subprocess.STDOUT if f else subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    proc.log = log
    _STARTED.append(proc)
    return proc


def pytest_sessionfinish():
    """Kill what start_python started and a failed test left running (a run of 100,000 steps), children too."""
    for proc in _STARTED:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_python(args, env=None, timeout=300):
    """subprocess.run([sys.executable, *args], capture_output=True, text=True) in the repo root; past
    `timeout` it is killed with all it started (subprocess.run's kill would leave torchrun's ranks)."""
    proc = start_python(args, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def wait_for(condition, *procs, timeout=180):
    """Until condition() holds, while each process in procs (start_python's) runs. Past `timeout`
    seconds, or once one of them has ended, the test fails with their output, and they are killed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(f"not within {timeout} s, or a process ended:\n" + "\n".join(map(output_of, procs)))
        time.sleep(0.05)


def logged_steps(metrics, n=1):
    """A condition for wait_for: the metrics.jsonl at `metrics` shows n logged steps (a run under way)."""
    return lambda: metrics.exists() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= n


def output_of(proc):
    """The tail of what a process of start_python's printed, once it is ended (killed, with what it started)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.log:
        proc.wait()
        return Path(proc.log).read_text()[-3000:]
    stdout, stderr = proc.communicate()
    return stdout[-3000:] + stderr[-3000:]


# train.py's flags for the torchrun tests: config/train_llama_tiny.py, 2 ranks x 4 micro-steps, 8 steps,
# evaluating at 0, 4 and 8 (each test file adds its model's size and levers)
TORCHRUN_ARGS = ["config/train_llama_tiny.py", "--block_size=32", "--batch_size=4", "--gradient_accumulation_steps=4"]
TORCHRUN_ARGS += ["--max_iters=8", "--lr_decay_iters=8", "--warmup_iters=2", "--eval_interval=4", "--log_interval=1"]


def torchrun(root, name, args, options=None, nodes=False, timeout=300):
    """train.py ARGS on 2 CPU ranks (gloo) as run `name`, each rank tests/train_rank.py with `options`
    (its OPTIONS: a NaN loss, the compile backend, what to record), its reports in root/name: one
    standalone torchrun launch, or with nodes=True two agents of one rank each meeting at a c10d
    rendezvous as two machines would. Killed, with the test failing, past `timeout` (a rank waiting
    for ever). Returns (the agents' exit codes, their stderr's tails, each rank's report: exit, its
    counters with record, stdout, stderr)."""
    (root / name).mkdir(exist_ok=True)  # a resume's: a copy of another run's
    options = dict(options or {})
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
    return [p.returncode for p in procs], "".join(err[-3000:] for _, err in outputs), rank_reports(root / name)


def rank_reports(run):
    """Each rank's report of the torchrun launch in `run` (exit, counters, stdout, stderr); exit None: the rank wrote none."""
    read = lambda path: path.read_text() if path.exists() else ""
    reports = [json.loads(read(run / f"rank{r}.json") or "{}") for r in range(2)]
    for r, report in enumerate(reports):
        report.setdefault("exit", None)
        report.update(stdout=read(run / f"rank{r}.out"), stderr=read(run / f"rank{r}.err"))
    return reports


def succeeded(launch):
    """A torchrun launch's ranks' reports, once every agent exited 0."""
    codes, stderr, ranks = launch
    assert codes == [0] * len(codes), stderr + "".join(r["stderr"][-3000:] for r in ranks)
    return ranks


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_chat_demo(root):
    """config/chat_demo_cpu.py's whole path, shortened, under root: 15,000 synthetic conversations
    (48 held out), the 512-token tokenizer, prepare.py, 180 steps of train.py at Muon's rate 0.03."""
    data, out = root / "data", root / "out"
    load_script("data/chat/synthetic.py").main([f"--out_dir={data}", "--n=15000", "--n_heldout=48", "--seed=0"])
    load_script("data/train_tokenizer.py").main(
        ["--input", f"{data}/text.txt", "--vocab_size=512", f"--out_dir={data}"]
    )
    prepare = ["--input", f"{data}/train.jsonl", f"--tokenizer={data}/tokenizer.json", f"--out_dir={data}"]
    load_script("data/chat/prepare.py").main([*prepare, "--block_size=128"])
    steps = [f"--{key}=180" for key in ("max_iters", "lr_decay_iters", "eval_interval")]
    train = ["config/chat_demo_cpu.py", f"--dataset={data}", f"--out_dir={out}", "--eval_iters=2", "--muon_lr=0.03"]
    result = run_script("train.py", *train, *steps)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="session")
def shared_chat_demo(tmp_path_factory):
    """The chat demo's path at 15% of its steps (Muon's learning rate 0.03 instead of 0.02: as many
    held-out answers right as 250 steps at 0.02), trained once per test run: the first pytest-xdist
    worker to ask builds it under a lock while the others wait. (out_dir, held-out conversations).
    Read it only; copy out_dir with chat_demo_copy to write there."""
    root = tmp_path_factory.getbasetemp()
    root = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "shared_chat_demo"  # above the workers'
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / "built").exists():
            shutil.rmtree(root, ignore_errors=True)  # a build cut short
            root.mkdir()
            _build_chat_demo(root)
            (root / "built").touch()
    return root / "out", [json.loads(line) for line in (root / "data" / "heldout.jsonl").read_text().splitlines()]


def chat_demo_copy(shared, to):
    """(a copy of shared_chat_demo's out_dir at `to`, to export into or train on; its held-out conversations)."""
    shutil.copytree(shared[0], to)
    return to, shared[1]
