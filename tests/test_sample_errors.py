"""sample.py's bad input: one line on stderr and a non-zero exit, or a documented behaviour."""

import pytest
from conftest import one_line_error
from processes import run_script

CONFIG_CASES = [
    (["--top_p=0"], ["top_p=0", "(0, 1]"]),
    (["--top_p=1.5"], ["top_p=1.5", "(0, 1]"]),
    (["--temperature=-0.5"], ["temperature=-0.5", ">= 0"]),
    (["--window_shift=0"], ["window_shift=0"]),
    (["--stream=maybe"], ["stream=maybe"]),
]


@pytest.mark.parametrize("argv, expected", CONFIG_CASES, ids=[" ".join(a) for a, _ in CONFIG_CASES])
def test_sample_config_errors(argv, expected):
    one_line_error(run_script("sample.py", "--device=cpu", *argv), *expected)


def sample_with(tiny_run, *args):
    return run_script(
        "sample.py", f"--out_dir={tiny_run}", "--device=cpu", "--max_new_tokens=5", "--num_samples=1", *args
    )


def test_prompts_file_problems(tiny_run, tmp_path):
    one_line_error(sample_with(tiny_run, "--prompts_file=/no/such/prompts.txt"), "/no/such/prompts.txt")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    one_line_error(sample_with(tiny_run, f"--prompts_file={blank}"), "no prompts")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("the king é\n".encode("latin-1"))
    one_line_error(sample_with(tiny_run, f"--prompts_file={latin1}"), "not UTF-8")


def test_window_shift_must_be_shorter_than_the_context(tiny_run):
    one_line_error(sample_with(tiny_run, "--window_shift=16"), "window_shift=16", "block_size=16")


def test_a_prompt_longer_than_block_size_is_cropped_with_a_note(tiny_run):
    # documented: the whole prompt is printed, the model conditions on its last block_size tokens
    long_prompt = "The king shall not be my lord now what is love"  # 46 characters, block_size 16
    result = sample_with(tiny_run, f"--start={long_prompt}", "--temperature=0", "--max_new_tokens=10")
    assert result.returncode == 0, result.stderr
    assert "note: the prompt is 46 tokens, more than block_size=16" in result.stderr
    assert "Traceback" not in result.stderr
    cropped = sample_with(tiny_run, f"--start={long_prompt[-16:]}", "--temperature=0", "--max_new_tokens=10")
    text, text_cropped = (r.stdout.split("\n", 1)[1] for r in (result, cropped))
    assert text.startswith(long_prompt) and text[len(long_prompt) :] == text_cropped[16:]
