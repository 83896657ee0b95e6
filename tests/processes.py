"""Running the repo's commands as a user runs them: run_script (main(argv) in-process, or a process),
start/run and start_python/run_python (real processes), torchrun (two ranks), Lighthouse (torchft's),
and what tests read of a running process. conftest.py kills at the session's end what start started."""

import functools
import importlib.util
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configurator import run_main  # after the path line above


def load_script(relpath):
    """Import a script that lives outside a package (train.py, data/<name>/prepare.py) as a module."""
    spec = importlib.util.spec_from_file_location(Path(relpath).stem, REPO / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(script, *args, cwd=REPO, env=None, isolated=False):
    """`python SCRIPT ARGS...` as a CompletedProcess: main(argv) in this process (a new interpreter's
    imports, torch's 2-3 CPU-s, are most of a small run's cost), ended as configurator.run_main ends it,
    file descriptors 1 and 2 captured. isolated=True: a process of its own, for settings read at import."""
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


STARTED = []


def start(argv, log=None, env=None, cwd=REPO, stdin=False, append=False):
    """subprocess.Popen(argv) as text, in a session of its own so that os.killpg reaches what it starts
    (torchrun's ranks). env: set on top of this process's (None removes one). Output to pipes, or to
    the file `log` for a process nobody reads while it runs (a full pipe stops it); stdin=True: a pipe."""
    environ = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    with open(log, "a" if append else "w") if log else nullcontext() as f:
        proc = subprocess.Popen(
            [*map(str, argv)],
            cwd=cwd,
            env=environ,
            stdin=subprocess.PIPE if stdin else None,
            stdout=f or subprocess.PIPE,
            stderr=subprocess.STDOUT if f else subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    proc.log = log
    STARTED.append(proc)
    return proc


def start_python(args, log=None, env=None, **options):
    """start([sys.executable, *args], ...): a Python process of this interpreter."""
    return start([sys.executable, *args], log, env, **options)


def run(argv, env=None, cwd=REPO, input=None, timeout=300):
    """subprocess.run(argv, capture_output=True, text=True, input=input); past `timeout` killed with all
    it started (subprocess.run's kill would leave torchrun's ranks), and TimeoutExpired raised."""
    proc = start(argv, env=env, cwd=cwd, stdin=input is not None)
    try:
        stdout, stderr = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_python(args, env=None, timeout=300, **options):
    """run([sys.executable, *args], ...): a Python process of this interpreter, waited for."""
    return run([sys.executable, *args], env, timeout=timeout, **options)


def wait_for(condition, *procs, timeout=180):
    """Until condition() holds; past `timeout`, or once one of procs ended, the test fails with their output."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(f"not within {timeout} s, or a process ended:\n" + "\n".join(map(output_of, procs)))
        time.sleep(0.05)


def finish(proc, timeout=120, expect=0):
    """The output of a process started with a log, once it exited with `expect` within `timeout` seconds."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"still running after {timeout} s: a group is waiting for ever")
    output = open(proc.log).read()
    assert proc.returncode == expect, output[-3000:]
    return output


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


# a command (train.py, scripts/chat_rl.py) run as its own process, sending itself signal SIG when its schedule asks
# for iter AT's learning rate (just before that step): a kill -9 or a preemption at a known step
SIGNAL_DRIVER = """
import os, runpy, signal, sys
sys.path.insert(0, {repo!r})
from gpt.train import optim
get_lr = optim.get_lr

def signalling_get_lr(it, cfg):
    if it == {at}:
        os.kill(os.getpid(), signal.{sig})
    return get_lr(it, cfg)

optim.get_lr = signalling_get_lr
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def signalled_run(tmp_path, script, sig, at, args):
    """SCRIPT ARGS run to its end after sending itself `sig` at iter `at`: run_python's result."""
    driver = tmp_path / "driver.py"
    driver.write_text(SIGNAL_DRIVER.format(repo=str(REPO), script=str(REPO / script), at=at, sig=sig))
    return run_python([driver, *args])


# what a test of CPU ranks needs
needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def torchrun(root, name, args, options=None, nodes=False, timeout=300):
    """train.py ARGS on 2 CPU ranks (gloo) as run `name`, each rank tests/train_rank.py with `options`,
    its reports in root/name: one standalone launch, or with nodes=True two agents of one rank each at a
    c10d rendezvous, as two machines. Killed, the test failing, past `timeout` (a rank waiting for ever).
    Returns (the agents' exit codes, their stderr's tails, each rank's report)."""
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


class Lighthouse:
    """torchft_lighthouse in a process of its own; address() as torchft's LighthouseServer has it."""

    def __init__(self, log, **flags):
        binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
        self.proc = start([binary, "--bind=[::]:0", *(f"--{k}={v}" for k, v in flags.items())], log)
        deadline = time.monotonic() + 60
        while not (found := re.search(r"listening on: (\S+)", open(log).read())):
            assert time.monotonic() < deadline and self.proc.poll() is None, open(log).read()
            time.sleep(0.05)
        self.url = found.group(1)

    def address(self):
        return self.url

    def shutdown(self):
        self.proc.kill()
        self.proc.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
