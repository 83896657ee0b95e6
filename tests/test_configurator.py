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


def parse_error(argv, cls=TrainConfig):
    with pytest.raises(UserError) as info:
        parse(cls, argv)
    return str(info.value)


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


def test_last_override_of_a_key_wins():
    assert parse(TrainConfig, ["--batch_size=2", "--batch_size=9"]).batch_size == 9


# ---------------------------------------------------------------------------- literal parsing


@pytest.mark.parametrize(
    "flag, key, expected, typ",
    [
        ("--dropout=0", "dropout", 0.0, float),  # nanoGPT's type check rejected this
        ("--learning_rate=1e-3", "learning_rate", 1e-3, float),
        ("--compile=False", "compile", False, bool),
        ("--compile=false", "compile", False, bool),
        ("--compile", "compile", True, bool),  # a bare flag switches a bool on
        ("--device=cpu", "device", "cpu", str),
        ("--device=cuda:1", "device", "cuda:1", str),
        ("--out_dir=out-shakespeare", "out_dir", "out-shakespeare", str),
        ("--max_iters=5e3", "max_iters", 5000, int),
        ("--max_iters=0", "max_iters", 0, int),
        ("--wandb_run_name=a=b", "wandb_run_name", "a=b", str),  # only the first '=' separates
        ("--wandb_run_name=2024", "wandb_run_name", "2024", str),
        ("--wandb_run_name=1e3", "wandb_run_name", "1e3", str),  # the text as typed, not '1000.0'
    ],
)
def test_cli_values_parse_as_literals(flag, key, expected, typ):
    value = getattr(parse(TrainConfig, [flag]), key)
    assert type(value) is typ
    assert value == expected


@pytest.mark.parametrize("flag, expected", [("--top_k=None", None), ("--top_k=5", 5), ("--top_k=5.0", 5)])
def test_optional_int(flag, expected):
    value = parse(SampleConfig, [flag]).top_k
    assert value == expected and type(value) is type(expected)


def test_str_key_keeps_text_that_looks_like_bool():
    assert parse(TrainConfig, ["--wandb_run_name=True"]).wandb_run_name == "True"


# ---------------------------------------------------------------------------- config files


def test_config_file_has_its_own_namespace(tmp_path):
    path = write(
        tmp_path,
        "cfg.py",
        "import math\n"
        "import os.path\n"
        "def _width(heads):\n"
        "    return 64 * heads\n"
        "def helper():\n"
        "    return 1\n"
        "class Thing:\n"
        "    pass\n"
        "_private = 123\n"
        "n_head = 2\n"
        "n_embd = _width(n_head)\n"
        "learning_rate = math.sqrt(1e-6)\n",
    )
    before = dict(vars(configurator))
    cfg = parse(TrainConfig, [path])
    assert (cfg.n_head, cfg.n_embd) == (2, 128)
    assert cfg.learning_rate == pytest.approx(1e-3)
    # nothing the file defined lands in configurator's globals
    assert vars(configurator).keys() == before.keys()
    assert all(vars(configurator)[k] is v for k, v in before.items())


def test_config_file_can_compute_values(tmp_path):
    path = write(
        tmp_path, "cfg.py", "import math\nn_head = 4\nn_embd = 64 * 2\nwarmup_iters = int(math.log2(1024)) * 10\n"
    )
    cfg = parse(TrainConfig, [path])
    assert (cfg.n_embd, cfg.warmup_iters) == (128, 100)


def test_config_file_values_are_type_checked(tmp_path):
    assert parse(TrainConfig, [write(tmp_path, "ok.py", "dropout = 0\n")]).dropout == 0.0
    message = parse_error([write(tmp_path, "bad.py", "batch_size = 'twelve'\n")])
    assert "batch_size" in message and "bad.py" in message


def test_from_import_of_a_builtin_is_ignored(tmp_path):
    path = write(tmp_path, "cfg.py", "from math import sqrt\nn_head = 4\nn_embd = int(sqrt(4096))\n")
    assert parse(TrainConfig, [path]).n_embd == 64


# ---------------------------------------------------------------------------- errors


def test_unknown_key_on_the_command_line_suggests_the_closest():
    message = parse_error(["--learnig_rate=1e-3"])
    assert "learnig_rate" in message and "learning_rate" in message
    assert "command line" in message


def test_unknown_key_in_a_config_file_names_the_file(tmp_path):
    path = write(tmp_path, "typo.py", "batch_sise = 4\n")
    message = parse_error([path])
    assert "batch_sise" in message and "batch_size" in message and "typo.py" in message


def test_unknown_key_without_close_match_points_to_help():
    message = parse_error(["--zzzzzz=1"])
    assert "zzzzzz" in message and "--help" in message


@pytest.mark.parametrize(
    "flag, key",
    [
        ("--batch_size=abc", "batch_size"),
        ("--compile=maybe", "compile"),
        ("--compile=1", "compile"),
        ("--batch_size=True", "batch_size"),  # bool is an int subclass, but not a batch size
        ("--batch_size=1.5", "batch_size"),
        ("--dropout=x", "dropout"),
        ("--dropout=True", "dropout"),
        ("--batch_size", "batch_size"),  # a bare flag is only for bools
    ],
)
def test_wrong_type_names_the_key(flag, key):
    assert key in parse_error([flag])


def test_top_k_rejects_text():
    assert "top_k" in parse_error(["--top_k=all"], SampleConfig)


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / "nope.py")
    assert "nope.py" in parse_error([missing])


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.py"
    path.write_bytes("batch_size = 4  # café\n".encode("latin-1"))
    assert "latin1.py" in parse_error([str(path)])


def test_config_file_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "broken.py", "batch_size = 4\nn_layer = = 2\n")
    message = parse_error([path])
    assert "broken.py:2:" in message


def test_config_file_runtime_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "raises.py", "batch_size = 4\n\nn_layer = 1 // 0\n")
    message = parse_error([path])
    assert "raises.py:3:" in message and "ZeroDivisionError" in message


def test_config_file_error_inside_a_helper_names_the_files_line(tmp_path):
    path = write(tmp_path, "helper.py", "def f():\n    return undefined_name\n\nn_layer = f()\n")
    message = parse_error([path])
    assert "helper.py:2:" in message and "NameError" in message


def test_config_file_error_raised_in_a_library_names_the_files_line(tmp_path):
    path = write(tmp_path, "lib.py", "import json\n\nn_layer = json.loads('{')\n")
    assert "lib.py:3:" in parse_error([path])  # the config file's line, not json/decoder.py's


@pytest.mark.parametrize(
    "argv, cls, key",
    [
        (["--n_embd=100", "--n_head=3"], TrainConfig, "n_embd"),
        (["--dropout=1.5"], TrainConfig, "dropout"),
        (["--dropout=-0.1"], TrainConfig, "dropout"),
        (["--init_from=bogus"], TrainConfig, "init_from"),
        (["--data_mode=disk"], TrainConfig, "data_mode"),
        (["--batch_size=0"], TrainConfig, "batch_size"),
        (["--grad_clip=-1"], TrainConfig, "grad_clip"),
        (["--warmup_iters=10", "--lr_decay_iters=5"], TrainConfig, "lr_decay_iters"),
        (["--temperature=-0.5"], SampleConfig, "temperature"),
        (["--top_k=0"], SampleConfig, "top_k"),
        (["--checkpoint=newest"], SampleConfig, "checkpoint"),
    ],
)
def test_out_of_range_values(argv, cls, key):
    assert key in parse_error(argv, cls)


def test_out_of_range_value_from_a_config_file(tmp_path):
    path = write(tmp_path, "cfg.py", "n_embd = 100\nn_head = 3\n")
    assert "n_head" in parse_error([path])


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


def test_run_main_turns_user_error_into_exit_2(capsys):
    def main():
        raise UserError("batch_size=abc (command line) is not a valid int")

    with pytest.raises(SystemExit) as info:
        configurator.run_main(main)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:")
    assert err.strip() == "error: batch_size=abc (command line) is not a valid int"
    assert len(err.strip().splitlines()) == 1


def test_run_main_exits_with_the_result_and_lets_bugs_through():
    with pytest.raises(SystemExit) as info:  # train.py returns 75 when it stopped early
        configurator.run_main(lambda: 75)
    assert info.value.code == 75
    with pytest.raises(SystemExit) as info:
        configurator.run_main(lambda: None)
    assert info.value.code == 0
    with pytest.raises(ZeroDivisionError):  # our own bugs keep their traceback
        configurator.run_main(lambda: 1 // 0)


def test_run_main_reports_a_parse_error_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        configurator.run_main(lambda: parse(TrainConfig, ["--learnig_rate=1"]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and "learning_rate" in err
