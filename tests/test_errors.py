"""Bad input: every case exits non-zero with one line that names the problem, no traceback,
and nothing already written is lost."""

import pytest
import torch
from conftest import one_line_error, tiny_args, tiny_bench_args
from processes import run_script

CONFIG_CASES = [
    (["--learnig_rate=1e-3"], ["learnig_rate", "did you mean learning_rate"]),
    (["--batch_size=abc"], ["batch_size=abc", "int"]),
    (["--compile=maybe"], ["compile=maybe", "bool"]),
    (["config/does_not_exist.py"], ["config file config/does_not_exist.py not found; check the path"]),
    (["config/train_shakespear_char.py"], ["not found; did you mean config/train_shakespeare_char.py?"]),
    (["--n_embd=30", "--n_head=4"], ["n_embd=30", "n_head=4"]),
    (["--device=tpu"], ["device='tpu'"]),
    (["--device=cuda"], ["no CUDA GPU"]),
    (["--dtype=fp8"], ["dtype='fp8'"]),
    (["--init_from=gpt7"], ["init_from='gpt7'"]),
    (["--keep_last=0"], ["keep_last=0"]),
    (["--dropout=1.5"], ["dropout=1.5"]),
]


@pytest.mark.parametrize("argv, expected", CONFIG_CASES, ids=[" ".join(a) for a, _ in CONFIG_CASES])
def test_train_config_errors(argv, expected, monkeypatch):
    # no GPU visible, so that --device=cuda is a mistake on a GPU machine too (CUDA_VISIBLE_DEVICES
    # would not do in this process: torch reads it once, at its first look for a GPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    one_line_error(run_script("train.py", *argv), *expected)


def test_config_file_with_an_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("batch_size = 8\nn_layer = = 3\n")
    one_line_error(run_script("train.py", bad), "bad.py:2")
    bad.write_text("batch_size = 8\nn_layer = undefined_name\n")
    one_line_error(run_script("train.py", bad), "bad.py:2", "NameError")


RANKS = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
RUN_CASES = {  # id: (train.py's keys over tiny_args', the environment, what the line holds)
    "missing-dataset": (
        dict(dataset="shakespeare_nope"),
        None,
        ["data/shakespeare_nope/train.bin not found", "prepare.py"],
    ),
    # 18,000 train tokens but only 2,000 val tokens: the val split is the one too short
    "block-size-past-the-data": (dict(block_size=5000), None, ["block_size=5000", "val.bin (2000 tokens)"]),
    "accumulation-among-ranks": (
        dict(gradient_accumulation_steps=3),
        RANKS,
        ["gradient_accumulation_steps=3", "multiple of 2"],
    ),
    "resume-without-a-checkpoint": (dict(init_from="resume"), None, ["no checkpoint", "ckpt.pt"]),
    "unwritable-out-dir": (dict(out_dir="a-file/out"), None, ["cannot write to out_dir"]),  # a folder in a file
}


@pytest.mark.parametrize("overrides, env, expected", RUN_CASES.values(), ids=RUN_CASES)
def test_train_run_errors(char_data, tmp_path, overrides, env, expected):
    (tmp_path / "a-file").write_text("a file, not a folder\n")
    args = tiny_args(char_data, **{**overrides, "out_dir": tmp_path / overrides.get("out_dir", "out")})
    one_line_error(run_script("train.py", *args, env=env), *expected)


def test_resume_with_a_different_model(tiny_run_copy, char_data):
    before = (tiny_run_copy / "ckpt.pt").read_bytes()
    result = run_script("train.py", *tiny_args(char_data, tiny_run_copy, init_from="resume", n_layer=3))
    one_line_error(result, "n_layer 2 -> 3")
    assert (tiny_run_copy / "ckpt.pt").read_bytes() == before


def test_corrupt_checkpoint(tiny_run_copy, char_data):
    (tiny_run_copy / "ckpt.pt").write_bytes(b"not a checkpoint at all")
    result = run_script("train.py", *tiny_args(char_data, tiny_run_copy, init_from="resume"))
    one_line_error(result, "ckpt.pt", "is damaged or not a checkpoint of this trainer")
    result = run_script("sample.py", f"--out_dir={tiny_run_copy}", "--checkpoint=latest", "--device=cpu")
    one_line_error(result, "ckpt.pt", "is damaged or not a checkpoint of this trainer")


SAMPLE_CASES = [
    (["--out_dir=/nonexistent/run"], ["/nonexistent/run does not exist"]),
    (["--temperature=-1"], ["temperature=-1"]),
    (["--top_k=0"], ["top_k=0"]),
    (["--num_samples=two"], ["num_samples=two"]),
]


@pytest.mark.parametrize("argv, expected", SAMPLE_CASES, ids=[" ".join(a) for a, _ in SAMPLE_CASES])
def test_sample_errors(argv, expected):
    one_line_error(run_script("sample.py", "--device=cpu", *argv), *expected)


def test_sample_prompt_problems(tiny_run):
    base = [f"--out_dir={tiny_run}", "--device=cpu", "--max_new_tokens=5", "--num_samples=1"]
    one_line_error(run_script("sample.py", *base, "--start=FILE:/no/such/prompt.txt"), "/no/such/prompt.txt")
    one_line_error(run_script("sample.py", *base, "--start="), "prompt is empty")
    one_line_error(run_script("sample.py", *base, "--start=§§"), "never saw")


BENCH_CASES = [
    (["--sweep=batch_size"], ["sweep='batch_size'", "batch_size=4,8,16,32"]),
    (["--sweep=batch_sise=4,8"], ["batch_sise", "did you mean batch_size"]),
    (["--data=real", "--dataset=/nonexistent/data"], ["/nonexistent/data/train.bin not found"]),
    (["--data=fake"], ["data='fake'"]),
    (["--bench_iters=abc"], ["bench_iters=abc", "int"]),
]


@pytest.mark.parametrize("argv, expected", BENCH_CASES, ids=[" ".join(a) for a, _ in BENCH_CASES])
def test_bench_errors(argv, expected):
    one_line_error(run_script("bench.py", *tiny_bench_args(), *argv), *expected)


def test_prepare_with_a_missing_input(tmp_path):
    result = run_script("data/shakespeare_char/prepare.py", "--input", tmp_path / "nope.txt", "--out_dir", tmp_path)
    one_line_error(result, "nope.txt")
    assert list(tmp_path.iterdir()) == []  # nothing written
