"""Shared test helpers: a tiny character dataset made on the spot, and running the scripts."""

import fcntl
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# torch.compile's backend for tests about graphs rather than kernels: dynamo's graphs, AOTAutograd's
# forward and backward (the partitioner's split) and inductor's decompositions, run by ATen's kernels.
# Inductor on a CPU builds each fused kernel with g++, about 1 s apiece with a cold cache (as in CI).
ATEN_BACKEND = "aot_eager_decomp_partition"


# The files that take 4 s or longer, longest first (seconds of wall time in a full `make test` of a
# fresh clone with a cold compile cache, as CI runs it, on this 2-core machine, 2026-11-26:
# test_serve 84, test_compile 46 (8 with a warm cache: its inductor test's g++ kernels),
# test_replicas 42, test_dist 35, test_watch 33, test_bench 29, test_core 25, test_gguf 23,
# test_checkpoint_format 21, test_sample 19, test_corpus 19, test_faults 16, test_hf, test_levers,
# test_cuda_contract, test_compare and test_diloco 15, test_serve_browser 11, then 8 to 4). make test
# hands whole files to its workers in this order, then the rest in collection order
# (--no-loadscope-reorder: pytest-xdist would otherwise order files by their number of tests): a
# long file that starts last leaves the other worker idle until it ends. Files that build a
# directory others share (conftest.shared_dir) go before the files that read it, so those find it
# built instead of waiting on its lock: test_serve builds the chat demo (test_gguf and test_chat),
# test_sample the Shakespeare model (test_train), and test_checkpoint_format the FSDP launches
# (test_fsdp).
LONGEST_FIRST = [
    "test_serve.py",
    "test_compile.py",
    "test_replicas.py",
    "test_dist.py",
    "test_watch.py",
    "test_bench.py",
    "test_core.py",
    "test_gguf.py",
    "test_checkpoint_format.py",
    "test_sample.py",
    "test_corpus.py",
    "test_faults.py",
    "test_hf.py",
    "test_levers.py",
    "test_cuda_contract.py",
    "test_compare.py",
    "test_diloco.py",
    "test_serve_browser.py",
    "test_documents.py",
    "test_chat.py",
    "test_logging.py",
    "test_chat_train.py",
    "test_eval.py",
    "test_commands.py",
    "test_optim.py",
    "test_outdir.py",
]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every file's own order, and the other files', is kept


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
    return char_dataset(tmp_path / "chars")


def char_dataset(data_dir):
    """data_dir, made if it is not there, holding make_text() prepared as a character-level dataset
    (train.bin, val.bin, meta.json)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    load_script("data/shakespeare_char/prepare.py").prepare(make_text(), str(data_dir))
    return data_dir


GPT2 = {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}  # tokenizer.describe of GPT-2's BPE
EVAL_WORDS = "the man picks up a ball and throws it to his dog who runs across the green field café naïve".split()


def hellaswag_record(rng, i, long=False):
    """A record in HellaSwag's official format (the fields eval.py ignores included)."""
    ctx = " ".join(rng.choice(EVAL_WORDS, size=60 if long else rng.integers(4, 12)))
    endings = [" ".join(rng.choice(EVAL_WORDS, size=rng.integers(1, 7))) + "." for _ in range(4)]
    return {
        "ind": i,
        "activity_label": "Playing fetch",
        "ctx_a": ctx,
        "ctx_b": "",
        "ctx": ctx,
        "split": "val",
        "split_type": "indomain",
        "label": int(rng.integers(4)),
        "endings": endings,
        "source_id": f"test~{i}",
    }


def write_hellaswag(path, n, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(hellaswag_record(rng, i, long=i % 7 == 0)) + "\n")
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
        tokens.write(
            str(data_dir / f"{split}.bin"),
            np.array([t for d in docs for t in [enc.eot_token] + enc.encode_ordinary(d)], dtype=np.uint16),
        )
    (data_dir / "meta.json").write_text(json.dumps(GPT2))
    return data_dir, write_hellaswag(root / "hs.jsonl", 30, seed=2)


def train_tiny_run(root, **overrides):
    """root/out: a tiny character model trained on root/chars for a few steps (block_size 16)."""
    data_dir = char_dataset(root / "chars")
    result = run_script("train.py", *tiny_args(data_dir, root / "out", **overrides))
    assert result.returncode == 0, result.stderr
    return root / "out"


def tiny_args(data_dir, out_dir, **overrides):
    """train.py flags for a model that trains in seconds on a CPU."""
    args = dict(
        device="cpu",
        compile=False,
        dataset=str(data_dir),
        out_dir=str(out_dir),
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=16,
        batch_size=4,
        gradient_accumulation_steps=1,
        max_iters=20,
        lr_decay_iters=20,
        warmup_iters=2,
        eval_interval=10,
        eval_iters=2,
        log_interval=1,
        learning_rate=1e-2,
        min_lr=1e-3,
        dropout=0.0,
    )
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


def in_child(fn, *args, timeout=240):
    """fn(*args) in a process of its own (python_process's fork server), its result sent back by pickle.

    For native code that can die on its own (llama.cpp): a signal there kills the child, not this
    pytest-xdist worker, and fails the calling test with one line naming the signal; a hang is
    ended at `timeout` seconds and fails it too. fn must be importable by name (a module-level
    function of a module on sys.path), and so must what it returns."""
    ctx = _server()  # a fork of a server that imported torch: ~2.4 s of CPU less than a fresh interpreter
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, fn, args, dict(os.environ)), daemon=True)
    child.start()
    send.close()
    what = f"{fn.__module__}.{fn.__name__} in a child process"
    result = None
    try:
        if receive.poll(timeout):
            result = receive.recv()
    except EOFError:  # the child ended without sending anything: it died
        pass
    finally:
        receive.close()
    child.join(30 if result is not None else 1)  # one that died has ended by now; one that hangs has not
    if child.exitcode is None:
        child.kill()
        child.join()
        pytest.fail(f"{what} gave no result in {timeout} s: killed", pytrace=False)
    if result is None:
        code = child.exitcode
        cause = f"died of {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
        pytest.fail(f"{what} {cause}", pytrace=False)
    ok, value = result
    if not ok:
        pytest.fail(f"{what} raised:\n{value}", pytrace=False)
    return value


def _child(send, fn, args, env):
    import traceback

    os.environ.clear()
    os.environ.update(env)

    try:
        result = (True, fn(*args))
    except BaseException:
        result = (False, traceback.format_exc())
    send.send(result)
    send.close()


# The environment this process started with: a fork server started later (python_process) gets it,
# not whatever a test has patched into os.environ by then.
_STARTING_ENVIRON = dict(os.environ)
_FORKED = []


def python_process(args, out=None, err=None, cwd=REPO, env=None, stdin=None):
    """`python ARGS...` (a script's path and its arguments, -m and a module's name and its
    arguments, or -c and code) in a new process, as subprocess.Popen([sys.executable, *args])
    starts it: stdout to the file `out` and stderr to `err` (or to `out` too; with neither, to
    files of its own that communicate() reads), stdin from the file `stdin` (or none), in a
    session of its own (os.killpg(proc.pid, ...) reaches what it starts). Returns a Popen-like
    handle: pid, poll, wait(timeout), communicate, returncode (-N when killed by signal N),
    send_signal, terminate, kill.

    The process is forked from a server (multiprocessing's forkserver, one per pytest worker) that
    imported torch once: `import torch` costs ~2.4 s of CPU on each interpreter start here, and
    the suite starts dozens of such processes. The script runs as __main__ with the given argv, env
    and cwd, and exits as an interpreter does: its non-daemon threads are joined and its atexit
    functions run. What is not a fresh interpreter: torch, numpy and torch._dynamo were imported
    before the environment was set (what they read from it at import time is _server's)."""
    import tempfile

    own = None
    if out is None:
        own = tempfile.mkdtemp(prefix="python_process-")
        out, err = Path(own) / "stdout", Path(own) / "stderr"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    child = _server().Process(
        target=_as_python,
        args=([*map(str, args)], str(out), str(err or out), str(cwd), full_env, stdin and str(stdin)),
        daemon=False,
    )
    child.start()
    _FORKED.append(_Forked(child, [*map(str, args)], (Path(out), Path(err or out)) if own else None))
    return _FORKED[-1]


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """python_process's server, started before any test: multiprocessing has one fork server per
    process, and serve.py's model process (gpt/serving.py) is forked from it too, which must
    not start it first without torch imported or with a test's patched environment."""
    _server()


def pytest_sessionfinish():
    """A python_process a test left running is killed (multiprocessing would wait for it as the
    pytest worker exits), and the files python_process made are removed."""
    for proc in _FORKED:
        proc.kill()
        if proc.files:
            shutil.rmtree(proc.files[0].parent, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A pytest-xdist worker exits here, without the interpreter's teardown. Its results are sent
    by then (xdist's workerfinished message, as pytest_sessionfinish ends), and what is left is
    freeing what its tests built: 4.7 s from a worker's unconfigure to its exit at the end of a
    cold make test, which waits for both workers (2026-11-26)."""
    if hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@functools.cache
def _server():
    """multiprocessing's forkserver context, its server started (once per pytest worker) with
    torch, numpy and torch._dynamo imported (~2 s of CPU each for torch and dynamo, which every
    train.py imports), in the environment the suite started with plus one OpenMP thread and
    inductor compiling in-process: OpenMP's threads do not survive a fork (a child sets its own
    number with torch.set_num_threads), and on a machine of a few cores a pool of compile workers
    in every process costs more to start than it saves."""
    import multiprocessing
    import multiprocessing.forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "numpy", "torch._dynamo"])
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({**_STARTING_ENVIRON, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return context


def _as_python(args, out, err, cwd, env, stdin=None):
    """python_process's child: its own session, its output to the files (its input from one), then
    _run_as_main."""
    os.setsid()
    for fd, path, flags in (
        (1, out, os.O_WRONLY | os.O_CREAT | os.O_APPEND),
        (2, err, os.O_WRONLY | os.O_CREAT | os.O_APPEND),
        (0, stdin, os.O_RDONLY),
    ):
        if path:
            target = os.open(path, flags)
            os.dup2(target, fd)
            os.close(target)
    if stdin:
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # multiprocessing gave the child os.devnull
    _run_as_main(args, cwd, env)


def piped_python(args, directory, env=None):
    """subprocess.Popen([sys.executable, *args], stdin=PIPE, stdout=PIPE, text=True) as a
    python_process: its stdin and stdout are named pipes in a new directory under `directory`, its
    stderr a file there. The handle's stdin and stdout are the pipes' other ends, as text, stdin
    line-buffered."""
    import tempfile

    here = Path(tempfile.mkdtemp(prefix="piped-", dir=directory))
    for name in ("stdin", "stdout"):
        os.mkfifo(here / name)
    proc = python_process(args, out=here / "stdout", err=here / "stderr", env=env, stdin=here / "stdin")
    proc.stdout = open(here / "stdout", encoding="utf-8")  # each returns once the process has opened its end
    proc.stdin = open(here / "stdin", "w", encoding="utf-8", buffering=1)
    return proc


def _run_as_main(args, cwd, env):
    """Run `python ARGS` in this (forked) process and exit as an interpreter would. torchrun's
    workers are forked from its agent too (_fork_workers): the agent has imported torch already."""
    import atexit
    import io
    import runpy
    import traceback

    sys.stdout, sys.stderr = (
        io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", write_through=True) for fd in (1, 2)
    )
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        if args[0] == "-m":
            if args[1] == "torch.distributed.run":
                _fork_workers()
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = args
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # as an interpreter's exit: its threads first, then its atexit functions
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fork_workers():
    """In a torchrun agent run by python_process: each worker torchrun starts (`python -u script
    args`, by subprocess.Popen in its SubprocessHandler) is forked from the agent instead, in a
    session of its own with the handler's output files, as Popen would have set it up. The rest
    is torchrun's own: rendezvous, the workers' environment, monitoring, signals, restarts."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    popen = subprocess_handler.SubprocessHandler._popen

    def forked(self, args, env):
        if args[:2] != (sys.executable, "-u"):
            return popen(self, args, env)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            for fd, f in ((1, self._stdout), (2, self._stderr)):
                if f is not None:
                    os.dup2(f.fileno(), fd)
            _run_as_main([*args[2:]], os.getcwd(), env)
        return _Pid(pid, args)

    subprocess_handler.SubprocessHandler._popen = forked


class _Pid:
    """subprocess.Popen's interface to a child forked by os.fork."""

    def __init__(self, pid, args):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class _Forked:
    """subprocess.Popen's interface to a python_process."""

    def __init__(self, process, args, files):
        self.process, self.args, self.pid, self.files = process, args, process.pid, files

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode

    def communicate(self, timeout=None):
        """(stdout, stderr) once it exited, from the files python_process made for them."""
        self.wait(timeout)
        return tuple(f.read_text(encoding="utf-8", errors="replace") if f.exists() else "" for f in self.files)

    def send_signal(self, sig):
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def run_script(script, *args, cwd=REPO, env=None, timeout=300, isolated=False, patched=False):
    """Run one of the repo's scripts as `python script args...` would; returns a CompletedProcess.

    By default it runs in this interpreter (runpy, as __main__, with file descriptors 1 and 2
    redirected, so output from C++ is caught too): a fresh interpreter costs ~1 s of imports,
    which over the suite's ~100 runs was most of `make test`'s time. isolated=True runs it in a
    process of its own (python_process), for what depends on one: import-time settings
    (HF_HUB_OFFLINE), module state, signals, a kill. GPT_TESTS_ISOLATED=1 makes every run isolated, except patched=True
    ones: the test has patched what the script calls (nan_steps), which only this process sees."""
    args = [*map(str, args)]
    if isolated or (os.environ.get("GPT_TESTS_ISOLATED") == "1" and not patched):
        return run_python([REPO / script, *args], cwd=cwd, env=env, timeout=timeout)
    return _run_in_process(REPO / script, args, cwd, env or {})


def run_python(args, cwd=REPO, env=None, timeout=300):
    """subprocess.run([sys.executable, *args], capture_output=True, text=True) in a
    python_process: a CompletedProcess; killed (its session) and TimeoutExpired past `timeout`."""
    proc = python_process(args, cwd=cwd, env=env)
    try:
        stdout, stderr = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess([sys.executable, *map(str, args)], proc.returncode, stdout, stderr)


@pytest.fixture
def forked_pythons(monkeypatch, tmp_path):
    """The Python processes a command starts with subprocess.run or subprocess.Popen of sys.executable
    (gpu_battery.py's and bench.py --compare's train.py runs, train.py's eval_async watcher) forked
    from python_process's server, which imported torch once, instead of started as fresh
    interpreters: the same arguments, working directory and output, ~4 CPU-s less each. Other commands (nvidia-smi, what the platform module
    asks) run as they would. Only the forms those commands use are taken; another fails the test."""
    run, popen, pipes = subprocess.run, subprocess.Popen, []

    def python_args(args):
        return args[2:] if args[1] == "-u" else args[1:]  # python_process's output is unbuffered anyway

    def forked_run(args, **kwargs):
        if args[0] != sys.executable:
            return run(args, **kwargs)
        if kwargs == {"capture_output": True, "text": True}:
            return run_python(python_args(args), cwd=os.getcwd())
        assert set(kwargs) == {"stdout", "stderr"} and kwargs["stderr"] == subprocess.STDOUT, kwargs
        kwargs["stdout"].flush()  # a file of the caller's: the process appends to it
        proc = python_process(python_args(args), out=kwargs["stdout"].name, cwd=os.getcwd())
        return subprocess.CompletedProcess(args, proc.wait())

    class Piped:
        """Popen(args, stdout=PIPE, stderr=STDOUT, text=True, bufsize=1), read line by line as the
        process writes them: its output goes through a named pipe."""

        def __init__(self, args):
            fifo = tmp_path / f"popen{len(pipes)}.out"
            os.mkfifo(fifo)
            pipes.append(fifo)
            self.process = python_process(python_args(args), out=fifo, cwd=os.getcwd())
            self.stdout = open(fifo, encoding="utf-8")  # returns once the process has opened its end

        @property
        def returncode(self):
            return self.process.returncode

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stdout.close()
            self.process.wait()

    class Inheriting(_Forked):
        """Popen(args, env=env): the process writes where this one's file descriptors 1 and 2 point
        (train.py's eval_async watcher, into run_script's capture), each through a named pipe that a
        thread copies to the descriptor; wait() and poll() return once both are copied."""

        def __init__(self, args, env):
            fifos = [tmp_path / f"popen{len(pipes)}.{name}" for name in ("out", "err")]
            for fifo in fifos:
                os.mkfifo(fifo)
                pipes.append(fifo)
            process = _server().Process(
                target=_as_python,
                args=(python_args(args), *map(str, fifos), os.getcwd(), {**env, "PYTHONUNBUFFERED": "1"}),
            )
            process.start()
            self.copies = [
                threading.Thread(target=self.copy, args=(fifo, fd), daemon=True) for fd, fifo in zip((1, 2), fifos)
            ]
            for thread in self.copies:
                thread.start()
            super().__init__(process, args, None)
            _FORKED.append(self)

        @staticmethod
        def copy(fifo, fd):
            with open(fifo, "rb", buffering=0) as pipe:  # opens once the process has opened its end
                while data := pipe.read(65536):
                    os.write(fd, data)

        def poll(self):
            return None if any(thread.is_alive() for thread in self.copies) else super().poll()

        def wait(self, timeout=None):
            code = super().wait(timeout)
            for thread in self.copies:
                thread.join()
            return code

    def forked_popen(args, **kwargs):
        if args[0] != sys.executable:
            return popen(args, **kwargs)
        if set(kwargs) == {"env"}:
            return Inheriting(args, kwargs["env"])
        assert kwargs == {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "bufsize": 1}, kwargs
        return Piped(args)

    monkeypatch.setattr(subprocess, "run", forked_run)
    monkeypatch.setattr(subprocess, "Popen", forked_popen)


def _run_in_process(path, args, cwd, env):
    import io
    import runpy
    import tempfile
    import traceback

    saved_argv, saved_cwd, saved_env = sys.argv, os.getcwd(), dict(os.environ)
    saved_streams, saved_fds = (sys.stdout, sys.stderr), (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        # write_through: Python's writes and C++'s land in the files in the order they happen
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", write_through=True) for fd in (1, 2)
        )
        sys.argv, code = [str(path), *args], 0
        os.environ.update(env)
        try:
            os.chdir(cwd)
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:
            code = exit_code(e)
        except BaseException:  # what an uncaught exception does to a real process
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            sys.stdout, sys.stderr = saved_streams
            sys.argv = saved_argv
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode("utf-8", errors="replace") for f in (out, err))
    return subprocess.CompletedProcess([sys.executable, str(path), *args], code, stdout, stderr)


@contextmanager
def nan_loss(model):
    """Every forward of `model` returns a NaN loss while inside: a step that diverged, as
    gpt.step.train_step meets one (its gradients are NaN too)."""
    handle = model.register_forward_hook(lambda module, args, out: (out[0], out[1] * float("nan")))
    try:
        yield
    finally:
        handle.remove()


def nan_steps(setattr, iters, ranks=None):
    """train.py's steps at `iters` (on `ranks`; None: every rank) get a NaN loss (nan_loss).
    gpt.step.train_step learns the iteration from the schedule, which train.py asks for each step's
    learning rate just before the step (gpt.optim.get_lr(iter_num, cfg)). `setattr` is
    monkeypatch.setattr in the test's process (then run_script(..., patched=True)), or the builtin
    in a torchrun driver, before it runs train.py."""
    from gpt import optim, step

    get_lr, train_step, now = optim.get_lr, step.train_step, {}

    def recording_get_lr(it, cfg):
        now["iter"] = it
        return get_lr(it, cfg)

    def nan_train_step(model, optimizer, scaler, next_batch, lr, accum_steps, grad_clip, rt):
        bad = now.get("iter") in iters and (ranks is None or rt.rank in ranks)
        with nan_loss(model) if bad else nullcontext():
            return train_step(model, optimizer, scaler, next_batch, lr, accum_steps, grad_clip, rt)

    setattr(optim, "get_lr", recording_get_lr)
    setattr(step, "train_step", nan_train_step)


def exit_code(e):
    """The exit status a process ends with on SystemExit e, as the interpreter gives it: a string
    is printed to stderr and exits 1, None is 0."""
    if isinstance(e.code, str):
        print(e.code, file=sys.stderr)
        return 1
    return e.code or 0


def train_in_rank(report, args, port=0, nan_iters=(), nan_ranks=None):
    """For a test's torchrun driver that runs several train.py runs one after the other in the same
    ranks: one run, `train.py ARGS` as __main__, with its stdout and stderr in report.out and
    report.err. port: after the first run, a store of its own on that port, hosted by rank 0
    (torchrun's keeps the previous process group's addresses). A NaN loss at nan_iters on
    nan_ranks (nan_steps; None: every rank), undone afterwards, as is a process group that a
    failed run left. Returns the run's exit code (1 for a traceback)."""
    import runpy
    import traceback

    import torch.distributed as dist

    if port:
        os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
    undo = []
    if nan_iters:
        nan_steps(
            lambda obj, attr, value: (undo.append((obj, attr, getattr(obj, attr))), setattr(obj, attr, value)),
            set(nan_iters),
            nan_ranks and set(nan_ranks),
        )
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, suffix in ((1, ".out"), (2, ".err")):
        f = os.open(report + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.argv, code = ["train.py", *args], 0
    try:
        runpy.run_path("train.py", run_name="__main__")
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for obj, attr, value in reversed(undo):
            setattr(obj, attr, value)
        if dist.is_initialized():  # train.py's teardown did not run
            dist.destroy_process_group()
    return code


def read_metrics(out_dir):
    import json

    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def shared_dir(tmp_path_factory, name, build):
    """A directory made once per test run by build(root) and shared by pytest-xdist's workers: the
    first to ask builds it under a lock while the others wait for it. Read it only."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above every worker's own
    root = root / name
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / "built").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            build(root)
            (root / "built").touch()
    return root


@pytest.fixture(scope="session")
def shared_chat_demo(tmp_path_factory):
    """The chat demo's path at 15% of its steps (15,000 conversations, 48 held out, 180 steps at
    Muon's learning rate 0.03 instead of 0.02: as many held-out answers right as 250 steps at 0.02),
    trained once per test run (shared_dir). (out_dir, held-out conversations). Read it only; copy
    out_dir with chat_demo_copy to write there."""
    build = functools.partial(train_chat_demo, n=15000, n_heldout=48, steps=180, muon_lr=0.03)
    root = shared_dir(tmp_path_factory, "shared_chat_demo", build)
    return root / "out", [json.loads(line) for line in (root / "data" / "heldout.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def shared_shakespeare(tmp_path_factory):
    """A model trained on the real tiny Shakespeare (SHAKESPEARE_TXT; the test skips without it),
    once per test run (shared_dir): 2 layers of 96, 400 steps, evaluated at 200 and 400 (val 2.25 at 400
    here; 128 wide at a learning rate of 5e-3 took 1.4 times as long for 2.21: 23.9 s against 17.5). Its out_dir;
    read it only."""
    if not os.environ.get("SHAKESPEARE_TXT"):
        pytest.skip("set SHAKESPEARE_TXT to the tiny Shakespeare text")

    def build(root):
        prepared = run_script(
            "data/shakespeare_char/prepare.py", "--input", os.environ["SHAKESPEARE_TXT"], "--out_dir", root / "data"
        )
        assert prepared.returncode == 0, prepared.stderr
        trained = run_script(
            "train.py",
            *tiny_args(
                root / "data",
                root / "out",
                n_layer=2,
                n_head=4,
                n_embd=96,
                block_size=64,
                batch_size=12,
                max_iters=400,
                lr_decay_iters=400,
                warmup_iters=50,
                learning_rate=7e-3,
                min_lr=7e-4,
                eval_interval=200,
                eval_iters=20,
            ),
            timeout=900,
        )
        assert trained.returncode == 0, trained.stderr

    return shared_dir(tmp_path_factory, "shared_shakespeare", build) / "out"


def chat_demo_copy(shared, to):
    """(a copy of the shared demo's out_dir at `to`, its held-out conversations): a module's own
    checkpoint directory, to export into or train on."""
    out_dir, heldout = shared
    shutil.copytree(out_dir, to)
    return to, heldout


def train_chat_demo(root, n, n_heldout, steps, muon_lr):
    """config/chat_demo_cpu.py's whole path, shortened, under root: n synthetic conversations (seed 0),
    the 512-token tokenizer, prepare.py, `steps` of train.py (in this process) at Muon's muon_lr.
    Returns (out_dir, the held-out conversations)."""
    data = root / "data"
    load_script("data/chat/synthetic.py").main(
        [f"--out_dir={data}", f"--n={n}", f"--n_heldout={n_heldout}", "--seed=0"]
    )
    load_script("data/train_tokenizer.py").main(
        ["--input", str(data / "text.txt"), "--vocab_size=512", f"--out_dir={data}"]
    )
    load_script("data/chat/prepare.py").main(
        [
            "--input",
            str(data / "train.jsonl"),
            f"--tokenizer={data / 'tokenizer.json'}",
            f"--out_dir={data}",
            "--block_size=128",
        ]
    )
    result = run_script(
        "train.py",
        "config/chat_demo_cpu.py",
        f"--dataset={data}",
        f"--out_dir={root / 'out'}",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        f"--eval_interval={steps}",
        "--eval_iters=2",
        f"--muon_lr={muon_lr}",
    )
    assert result.returncode == 0, result.stderr
    return root / "out", [json.loads(line) for line in (data / "heldout.jsonl").read_text().splitlines()]
