"""Every command imports and parses in a fresh interpreter, as a user runs it (the rest of the suite
mostly calls main(argv) in-process)."""

import pytest
from processes import run_script, start_python

pytestmark = pytest.mark.process  # every test here starts a process

COMMANDS = [
    "train.py",
    "sample.py",
    "eval.py",
    "hf.py",
    "bench.py",
    "plot.py",
    "scripts/checkpoint_convert.py",
    "serve.py",
    "data/shakespeare_char/prepare.py",
    "data/shakespeare/prepare.py",
    "data/openwebtext/prepare.py",
    "data/fineweb_edu/prepare.py",
    "chat.py",
    "data/train_tokenizer.py",
    "data/chat/prepare.py",
    "data/chat/synthetic.py",
    "scripts/chat_eval.py",
    "scripts/gpu_battery.py",
]


@pytest.mark.parametrize("script", COMMANDS)
def test_help_in_a_process_of_its_own(script):
    result = run_script(script, "--help", isolated=True)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower() or "--" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_help_into_a_reader_gone_away_ends_quietly(script):
    """`python train.py --help | head -5`: ends as a Unix tool does (141, SIGPIPE's), no traceback."""
    proc = start_python([script, "--help"])
    proc.stdout.close()  # gone before anything is written
    stderr = proc.stderr.read()
    assert (proc.wait(timeout=120), stderr) == (141, "")
