"""Every `python <script>.py ...` and `torchrun ... <script>.py ...` line in a code block of README.md,
BENCHMARKS.md and docs/*.md names a script and config files that exist, and only --keys the script
accepts: read from the script run with --help in this process, its config dataclass or argparse
parser caught before anything is printed."""

import argparse
import dataclasses
import functools
import itertools
import os
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

import configurator

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
PYTHON = re.compile(r"(.*/)?python(3(\.\d+)?)?$")  # python, python3, python3.11, .venv/bin/python
SHELL_OPERATORS = {"&&", "||", "|", ";", "&", ">", ">>", "<", "2>", "2>&1"}
MENTIONS_COMMAND = re.compile(r"(^|[\s/])(python[\d.]*|torchrun)\s")
NOT_SHELL = {"python", "json", "jinja", "text"}  # code blocks whose lines are not commands


@dataclasses.dataclass
class Command:
    where: str  # file:line, for the failure message
    script: str  # relative to the repo root
    args: list
    error: str = ""


def code_lines(path):
    """(line number, text) of each logical shell line in the file's fenced code blocks: lines joined
    at a trailing backslash, numbered by their first line."""
    fence, pending, start = None, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            pending = ""
            continue
        if fence is None or fence in NOT_SHELL:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + stripped
        pending = ""


def commands_in(path):
    for number, line in code_lines(path):
        if not MENTIONS_COMMAND.search(line):
            continue  # a file tree, a REPL session: not split as shell
        where = f"{path.relative_to(REPO)}:{number}"
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as e:
            yield Command(where, None, [], error=f"cannot split the shell line ({e}): {line}")
            continue
        # one pipeline or list at a time: `a && b` is two commands
        split = itertools.groupby(tokens, lambda token: token in SHELL_OPERATORS)
        for tokens in (list(segment) for operator, segment in split if not operator):
            script, args = script_and_args(tokens)
            if script:
                yield Command(where, script, args)


def script_and_args(tokens):
    """(script, its arguments) of one shell command, or (None, None) when it runs no script."""
    for i, token in enumerate(tokens):
        if PYTHON.match(token):
            rest = tokens[i + 1 :]
            if not rest or rest[0].startswith("-") or not rest[0].endswith(".py"):
                return None, None  # python -m ..., python -c ..., a bare interpreter
            return rest[0], rest[1:]
        if token == "torchrun":
            for j, arg in enumerate(tokens[i + 1 :], i + 1):
                if arg.endswith(".py"):
                    return arg, tokens[j + 1 :]
            return None, None
    return None, None


ALL = [c for path in DOCS for c in commands_in(path)]


class Caught(BaseException):
    """Raised out of the script at its --help: what it parses with. A BaseException, so that no
    `except Exception` in the script swallows it."""


@functools.cache
def accepted(script):
    """('config', dataclass) or ('argparse', option strings) for a script, from running it with
    --help in this process with the two ways of printing help intercepted."""

    def caught_usage(cls):
        raise Caught("config", cls)

    def caught_help(parser, file=None):
        raise Caught("argparse", parser)

    saved = sys.argv, os.getcwd(), configurator.usage, argparse.ArgumentParser.print_help
    sys.argv = [str(REPO / script), "--help"]
    configurator.usage, argparse.ArgumentParser.print_help = caught_usage, caught_help
    try:
        os.chdir(REPO)
        runpy.run_path(str(REPO / script), run_name="__main__")
    except Caught as e:
        kind, what = e.args
        if kind == "config":
            return "config", {f.name for f in dataclasses.fields(what)}
        return "argparse", {option for option in what._option_string_actions}
    except (SystemExit, Exception):  # it printed its own usage, or took --help for a file name
        pass
    finally:
        sys.argv, cwd, configurator.usage, argparse.ArgumentParser.print_help = saved
        os.chdir(cwd)
    return None, set()


def test_the_docs_have_commands_to_check():
    scripts = {c.script for c in ALL if not c.error}
    assert {"train.py", "sample.py", "chat.py", "serve.py", "eval.py", "hf.py", "bench.py"} <= scripts, scripts


@pytest.mark.parametrize("command", ALL, ids=lambda c: f"{c.where} {c.script}")
def test_every_documented_command_names_real_files_and_known_keys(command):
    where, script = command.where, command.script
    assert not command.error, f"{where}: {command.error}"
    assert (REPO / script).is_file(), f"{where}: {script} does not exist"
    flags = [a for a in command.args if a.startswith("--") and a != "--help"]
    kind, keys = accepted(script) if command.args else (None, set())
    if kind == "config":
        # configurator.parse reads every positional argument as a config file
        for arg in command.args:
            if not arg.startswith(("-", "$")):  # "$@" in a batch script is the caller's
                assert (REPO / arg).is_file(), f"{where}: config file {arg} (for {script}) does not exist"
        for flag in flags:
            key = flag[2:].partition("=")[0]
            assert key in keys, f"{where}: {script} has no key --{key} (python {script} --help lists its keys)"
    elif kind == "argparse":
        for flag in flags:
            option = flag.partition("=")[0]
            assert option in keys, (
                f"{where}: {script} has no option {option} (python {script} --help lists its options)"
            )
    elif flags:
        pytest.fail(
            f"{where}: {script} was given {' '.join(flags)}, but its --help shows no keys to check them against"
        )
