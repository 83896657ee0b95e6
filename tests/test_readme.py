"""README.md from the top, as a user on a CPU machine follows it: its shell blocks in order, each
line in bash, in a fresh copy of the tree, after `. .venv/bin/activate` once the README says to.

Where this differs from a user, and why: `.venv` is a link to this suite's venv (building one is
minutes and ~1.8 GB; tests/test_make_venv.py checks what make installs); Tiny Shakespeare is put in
data/shakespeare_char/input.txt (from $SHAKESPEARE_TXT, else made-up text), as the README tells a
user without network to do; SHORTER shortens the training commands, FEW_SAMPLES the sampling ones; serve.py
runs until it answers its page on a free port; chat.py gets one line on stdin; SKIPPED says why a block is not run here.
A command the README gains fails this test until it is in one of these tables or runs cheaply."""

import os
import shutil
import sys
import time
import urllib.request

import pytest
from conftest import make_text, tree_files
from processes import REPO, free_port, output_of, run, start

pytestmark = [pytest.mark.process, pytest.mark.slow]

SHORT = "--max_iters=4 --lr_decay_iters=4 --warmup_iters=1 --eval_interval=2 --eval_iters=1 --log_interval=2"
FEW_SAMPLES = "--num_samples=1 --max_new_tokens=50"  # appended to each `python sample.py` line
NANOGPT_CPU = (
    "python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 "
    "--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 "
    "--dropout=0.0"
)
SHORTER = {  # a README line -> what is appended to it here
    "make quickstart": f'TRAIN_ARGS="{SHORT}"',
    "make chat-demo": f'TRAIN_ARGS="{SHORT}"',
    "python train.py config/train_shakespeare_char_cpu.py --overwrite=True": SHORT,
    NANOGPT_CPU: SHORT,
    "python train.py config/train_shakespeare_char_cpu.py --init_from=resume": SHORT,
    "python train.py config/train_shakespeare_char_cpu.py --init_from=resume --max_iters=900 --lr_decay_iters=900": (
        SHORT.replace("=4", "=6")
    ),
    "python train.py config/train_shakespeare_char_cpu.py --eval_async=True --keep_last=2 --out_dir=out-watched": SHORT,
}
SKIPPED = {  # a README line -> why it is not run here
    "make test": "the suite this test is part of",
    "make test-fast": "the suite this test is part of",
    ".venv/bin/python -m pytest -q tests/test_train.py": "the suite this test is part of",
    "SHAKESPEARE_TXT=/path/to/input.txt make test": "the suite this test is part of",
    "python train.py config/train_shakespeare_char.py": "a GPU's: 5,000 steps of a 10M model, hours on a CPU",
    "python train.py config/train_shakespeare_char_fast.py --overwrite=True": "a GPU's (the quick start there)",
    "python data/fineweb_edu/prepare.py --tokens=10e9": "downloads FineWeb-Edu",
    "torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py": "8 GPUs",
    "python eval.py --init_from=gpt2 --tasks=hellaswag,core": "downloads GPT-2, HellaSwag and CORE",
    'python bench.py config/train_shakespeare_char_cpu.py --against="--mlp=gelu" --seeds=5': (
        "ten training runs; tests/test_compare.py runs --against small"
    ),
    "python bench.py config/train_shakespeare_char_cpu.py --sweep=batch_size=4,8,16,32": (
        "minutes of timed steps; tests/test_bench.py runs sweeps"
    ),
}


def shell_lines(path):
    """Each line of the file's ```sh blocks, in order, less its comment, backslash continuations joined."""
    lines, fence, pending = [], None, ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        if fence != "sh":
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        code = " ".join((pending + stripped).split(" #")[0].split())  # the README quotes no " #"
        pending = ""
        if code and not code.startswith("#"):
            lines.append(code)
    return lines


def fresh_copy(to):
    """The tree as a fresh clone has it, with the files' times (make compares them with the venv's install)."""
    for name in tree_files():
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, to / name)
    return to


def test_a_copy_that_is_no_checkout_lists_the_files_a_checkout_lists(tmp_path):
    """tree_files without .git (a downloaded archive) lists what git lists in a checkout, runs' leftovers aside."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    root = fresh_copy(tmp_path / "tree")
    made = ["out-run/ckpt.pt", "out/hf/modeling_gpt_trainer.py", "gpt/outdir/__pycache__/lock.cpython-311.pyc"]
    made += ["data/shakespeare_char/input.txt", "data/shakespeare_char/train.bin", "data/chat/meta.json"]
    made += ["data/hellaswag/val.jsonl", "wandb/run/a.txt", "runs/tb/events", ".ruff_cache/0.1/cache", "notes.txt"]
    for name in made:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("made by a run\n")
    (root / ".ruff_cache" / ".gitignore").write_text("*\n")  # as ruff writes it
    (root / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    assert run(["git", "init", "-q"], cwd=root).returncode == 0
    by_git = tree_files(root)
    shutil.rmtree(root / ".git")
    assert tree_files(root) == by_git
    assert set(by_git) == set(tree_files()) | {"notes.txt"}  # of what runs made, only what git would add


def serve_until_it_answers(command, cwd, env):
    """serve.py started, its page fetched once it listens, then stopped; (exit code, output)."""
    port = free_port()
    log = cwd.parent / f"serve-{port}.log"  # beside the copy, not in it
    proc = start(["bash", "-c", f"{command} --port={port}"], log, env, cwd)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                    assert page.status == 200 and b"<html" in page.read().lower()
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"serve.py never answered on port {port}: {output_of(proc)}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return 0, log.read_text()


def test_the_readme_runs_in_order_on_a_fresh_copy(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("needs make")
    root = fresh_copy(tmp_path / "gpt-trainer")
    (root / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    text = os.environ.get("SHAKESPEARE_TXT")
    if text:
        shutil.copy(text, root / "data" / "shakespeare_char" / "input.txt")
    else:
        # with the speakers the README's prompts name, so that their characters are in the vocabulary
        speakers = "\n".join(
            f"{name}:\n{line}" for name, line in zip(["ROMEO", "JULIET"] * 50, make_text(4000).split("\n"))
        )
        (root / "data" / "shakespeare_char" / "input.txt").write_text(make_text(200_000) + "\n" + speakers)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if sys.prefix not in p)
    env = dict(VIRTUAL_ENV=None, SHAKESPEARE_TXT=None, OMP_NUM_THREADS="1", PATH=path)
    # make must take the venv as installed: its requirement files are at least as old as its install
    installed = (root / ".venv" / ".installed").stat().st_mtime if (root / ".venv" / ".installed").exists() else None
    assert installed, f"{sys.prefix} has no .installed: make it with make venv"
    for name in ("requirements.txt", "requirements-dev.txt", "scripts/system_torch.py"):
        os.utime(root / name, (installed - 1, installed - 1))

    lines = shell_lines(REPO / "README.md")
    assert lines[0] == "make quickstart" and ". .venv/bin/activate" in lines
    activated, ran, skipped = False, [], []
    for line in lines:
        why = SKIPPED.get(line)
        if why:
            skipped.append(f"{line}: {why}")
            continue
        extra = SHORTER.get(line, FEW_SAMPLES if line.startswith("python sample.py") else None)
        command = f"{line} {extra}" if extra else line
        if line == ". .venv/bin/activate":
            activated = True
            continue
        shell = f". .venv/bin/activate && {command}" if activated else command
        start = time.monotonic()
        if line.startswith("python serve.py"):
            code, output = serve_until_it_answers(shell.replace("&& python", "&& exec python"), root, env)
        else:
            stdin = "My name is Dovaki.\n" if line.startswith("python chat.py") else ""
            result = run(["bash", "-c", shell], env=env, cwd=root, input=stdin, timeout=600)
            code, output = result.returncode, result.stdout + result.stderr
        assert code == 0, f"README: `{line}` (run as `{command}`) exited {code}:\n{output[-3000:]}"
        assert "Traceback" not in output, f"README: `{line}`:\n{output[-3000:]}"
        ran.append((line, time.monotonic() - start, output))
        if line == "make quickstart":
            assert "make quickstart is done: the run is in out-shakespeare-char-cpu" in output
            assert ". .venv/bin/activate" in output
        if line == "make chat-demo":
            assert "python chat.py --out_dir=out-chat-demo" in output and "python serve.py" in output
        if line.startswith("python train.py"):
            assert any(out.startswith("done: iter ") for out in output.splitlines()), output[-2000:]
    print("\n".join(f"{seconds:6.1f} s  {line}" for line, seconds, _ in ran))
    print("skipped:\n" + "\n".join(skipped))
    assert len(ran) >= 15 and (root / "out-shakespeare-char-cpu" / "hf" / "modeling_gpt_trainer.py").is_file()
    assert (root / "out-chat-demo" / "model.gguf").exists() or any((root / "out-chat-demo").glob("*.gguf"))
