"""configurator.parse: precedence, literal parsing, config files, errors, --help, run_main."""

import dataclasses
import inspect
import io
import tokenize

import pytest

import configurator
from configurator import TrainConfig, UserError, parse
from model import GPTConfig
from sample import SampleConfig


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------- precedence


def test_defaults_when_argv_is_empty():
    assert parse(TrainConfig, []) == TrainConfig()
    assert parse(SampleConfig, []) == SampleConfig()


def test_files_in_argv_order_then_overrides_win(tmp_path):
    first = write(tmp_path, "first.py", "batch_size = 3\nblock_size = 32\nn_layer = 2\n")
    second = write(tmp_path, "second.py", "batch_size = 5\n")
    cfg = parse(TrainConfig, [first, second])
    assert (cfg.batch_size, cfg.block_size, cfg.n_layer) == (5, 32, 2)  # the later file wins where both set a key
    assert cfg.n_head == TrainConfig().n_head  # keys no file sets keep their default
    # an override wins even when it is written before the file
    cfg = parse(TrainConfig, ["--batch_size=7", first, second, "--n_layer=4"])
    assert (cfg.batch_size, cfg.block_size, cfg.n_layer) == (7, 32, 4)
    assert parse(TrainConfig, ["--batch_size=2", "--batch_size=9"]).batch_size == 9  # the last override of a key


# ---------------------------------------------------------------------------- literal parsing


@pytest.mark.parametrize(
    "flag, key, expected",
    [
        ("--dropout=0", "dropout", 0.0),  # nanoGPT's type check rejected this
        ("--learning_rate=1e-3", "learning_rate", 1e-3),
        ("--compile=False", "compile", False),
        ("--compile=false", "compile", False),
        ("--compile", "compile", True),  # a bare flag switches a bool on
        ("--device=cpu", "device", "cpu"),
        ("--device=cuda:1", "device", "cuda:1"),
        ("--out_dir=out-shakespeare", "out_dir", "out-shakespeare"),
        ("--max_iters=5e3", "max_iters", 5000),
        ("--max_iters=0", "max_iters", 0),
        ("--wandb_run_name=a=b", "wandb_run_name", "a=b"),  # only the first '=' separates
        ("--wandb_run_name=2024", "wandb_run_name", "2024"),
        ("--wandb_run_name=1e3", "wandb_run_name", "1e3"),  # the text as typed, not '1000.0'
        ("--wandb_run_name=True", "wandb_run_name", "True"),  # a str key keeps text that looks like a bool
    ],
)
def test_cli_values_parse_as_literals(flag, key, expected):
    value = getattr(parse(TrainConfig, [flag]), key)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("flag, expected", [("--top_k=None", None), ("--top_k=5", 5), ("--top_k=5.0", 5)])
def test_optional_int(flag, expected):
    value = parse(SampleConfig, [flag]).top_k
    assert value == expected and type(value) is type(expected)


# ---------------------------------------------------------------------------- config files


def test_a_config_file_computes_in_a_namespace_of_its_own(tmp_path):
    text = """\
import math
import os.path
from math import sqrt
def _width(heads):
    return 64 * heads
def helper():
    return 1
class Thing:
    pass
_private = 123
n_head = 2
n_embd = _width(n_head)
learning_rate = math.sqrt(1e-6)
warmup_iters = int(math.log2(1024)) * 10
n_layer = int(sqrt(16))
dropout = 0
"""
    before = dict(vars(configurator))
    cfg = parse(TrainConfig, [write(tmp_path, "cfg.py", text)])
    assert (cfg.n_head, cfg.n_embd, cfg.warmup_iters, cfg.n_layer) == (2, 128, 100, 4)
    assert cfg.learning_rate == pytest.approx(1e-3)
    assert cfg.dropout == 0.0 and type(cfg.dropout) is float  # type-checked as the command line is
    # nothing the file defined lands in configurator's globals
    assert vars(configurator).keys() == before.keys()
    assert all(vars(configurator)[k] is v for k, v in before.items())


# ---------------------------------------------------------------------------- errors

# config files with a mistake, written for every case of MISTAKES (whose argv names them by file name)
BAD_FILES = {
    "typo.py": "batch_sise = 4\n",
    "bad.py": "batch_size = 'twelve'\n",
    "latin1.py": "batch_size = 4  # café\n".encode("latin-1"),
    "raises.py": "batch_size = 4\n\nn_layer = 1 // 0\n",
    "helper.py": "def f():\n    return undefined_name\n\nn_layer = f()\n",
    "lib.py": "import json\n\nn_layer = json.loads('{')\n",  # the config file's line, not json/decoder.py's
    "heads.py": "n_embd = 100\nn_head = 3\n",
}
TAKEOVER = "overwrite=True replaces the run in out_dir, init_from='{}' continues it"
# (the config class, argv, what the one-line message must name); what train.py and sample.py say of other
# mistakes through parse (a type, a range, a syntax error): test_errors.py, test_sample_errors.py
MISTAKES = [
    (TrainConfig, ["--learnig_rate=1e-3"], ["learnig_rate", "learning_rate", "command line"]),  # the closest key
    (TrainConfig, ["typo.py"], ["batch_sise", "batch_size", "typo.py"]),
    (TrainConfig, ["--zzzzzz=1"], ["zzzzzz", "--help"]),  # no close key
    (TrainConfig, ["--compile=1"], ["compile"]),
    (TrainConfig, ["--batch_size=True"], ["batch_size"]),  # bool is an int subclass, but not a batch size
    (TrainConfig, ["--batch_size=1.5"], ["batch_size"]),
    (TrainConfig, ["--dropout=x"], ["dropout"]),
    (TrainConfig, ["--dropout=True"], ["dropout"]),
    (TrainConfig, ["--batch_size"], ["batch_size"]),  # a bare flag is only for bools
    (TrainConfig, ["bad.py"], ["batch_size", "bad.py"]),
    (SampleConfig, ["--top_k=all"], ["top_k"]),
    (TrainConfig, ["nope.py"], ["nope.py"]),  # missing
    (TrainConfig, ["latin1.py"], ["latin1.py"]),  # not UTF-8
    (TrainConfig, ["raises.py"], ["raises.py:3:", "ZeroDivisionError"]),
    (TrainConfig, ["helper.py"], ["helper.py:2:", "NameError"]),
    (TrainConfig, ["lib.py"], ["lib.py:3:"]),
    (TrainConfig, ["heads.py"], ["n_head"]),
    (TrainConfig, ["--dropout=-0.1"], ["dropout"]),
    (TrainConfig, ["--data_mode=disk"], ["data_mode"]),
    (TrainConfig, ["--batch_size=0"], ["batch_size"]),
    (TrainConfig, ["--grad_clip=-1"], ["grad_clip"]),
    (TrainConfig, ["--warmup_iters=10", "--lr_decay_iters=5"], ["lr_decay_iters"]),
    (SampleConfig, ["--checkpoint=newest"], ["checkpoint"]),
    (TrainConfig, ["--overwrite=True", "--init_from=resume"], [TAKEOVER.format("resume")]),
    (TrainConfig, ["--overwrite=True", "--init_from=auto"], [TAKEOVER.format("auto")]),
]


@pytest.mark.parametrize("cls, argv, fragments", MISTAKES, ids=[" ".join(argv) for _, argv, _ in MISTAKES])
def test_a_mistake_is_named(tmp_path, cls, argv, fragments):
    for name, text in BAD_FILES.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError) as info:
        parse(cls, [str(tmp_path / a) if a.endswith(".py") else a for a in argv])
    assert all(fragment in str(info.value) for fragment in fragments), str(info.value)


# ---------------------------------------------------------------------------- --help


def _source_comments(cls):
    """Each field's trailing comment, read with tokenize (independently of configurator's regex)."""
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline):
        if tok.type == tokenize.COMMENT:
            name, colon, _ = tok.line.partition(":")
            if colon and name.strip().isidentifier():  # `name: type = default  # comment`
                comments[name.strip()] = tok.string.lstrip("#").strip()
    return comments


@pytest.mark.parametrize("cls", [TrainConfig, SampleConfig])
def test_help_lists_every_key_with_default_and_comment(cls, capsys):
    with pytest.raises(SystemExit) as info:
        parse(cls, ["--help"])
    assert info.value.code in (0, None)
    out = capsys.readouterr().out
    lines = {line.split("=")[0].strip(): line for line in out.splitlines() if line.strip().startswith("--")}
    comments = {**_source_comments(GPTConfig), **_source_comments(cls)}  # the model's keys: described on GPTConfig
    for f in dataclasses.fields(cls):
        line = lines[f"--{f.name}"]
        assert repr(f.default) in line, line
        assert f.name in comments, f"{f.name} has no comment to show"
        assert comments[f.name] in line, line


def test_help_wins_over_other_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        parse(TrainConfig, ["--batch_size=abc", "-h"])
    assert info.value.code in (0, None)
    assert "--batch_size" in capsys.readouterr().out


# ---------------------------------------------------------------------------- run_main


def raise_a_user_error():
    raise UserError("batch_size=abc (command line) is not a valid int")


@pytest.mark.parametrize(
    "main, line",
    [
        (raise_a_user_error, "error: batch_size=abc (command line) is not a valid int"),
        (
            lambda: parse(TrainConfig, ["--learnig_rate=1"]),
            "error: unknown config key 'learnig_rate' on the command line; did you mean learning_rate?",
        ),
    ],
    ids=["user-error", "parse-error"],
)
def test_run_main_turns_a_user_error_into_one_line_and_exit_2(capsys, main, line):
    with pytest.raises(SystemExit) as info:
        configurator.run_main(main)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.strip() == line and len(err.strip().splitlines()) == 1


def test_run_main_exits_with_the_result_and_lets_bugs_through():
    with pytest.raises(SystemExit) as info:  # train.py returns 75 when it stopped early
        configurator.run_main(lambda: 75)
    assert info.value.code == 75
    with pytest.raises(SystemExit) as info:
        configurator.run_main(lambda: None)
    assert info.value.code == 0
    with pytest.raises(ZeroDivisionError):  # our own bugs keep their traceback
        configurator.run_main(lambda: 1 // 0)
