"""gpt/weights/load.py, the one place that knows where weights come from: a run named by --out_dir with
init_from=resume and the same run named by init_from read the same weights, in every command that
reads a model; the chat template's refusal names the run; and what is not a source gets one line."""

import pytest
import torch
from processes import run_script

from configurator import UserError
from gpt.weights import load


def test_a_run_named_by_init_from_is_the_run_resume_reads(tiny_run):
    for which in ("best", "latest"):
        model, spec = load.for_inference("resume", str(tiny_run), which, report=lambda line: None)
        again, spec_again = load.for_inference(str(tiny_run), None, which, report=lambda line: None)
        assert spec == spec_again and spec["kind"] == "char"
        theirs = again.state_dict()
        assert all(torch.equal(value, theirs[name]) for name, value in model.state_dict().items())


def test_sample_and_eval_read_a_run_named_by_init_from(tiny_run):
    flags = ["--device=cpu", "--num_samples=1", "--max_new_tokens=20", "--seed=3", "--start=Th"]
    by_out_dir = run_script("sample.py", f"--out_dir={tiny_run}", *flags)
    by_init_from = run_script("sample.py", f"--init_from={tiny_run}", *flags)
    assert by_out_dir.returncode == 0 and by_init_from.returncode == 0, by_init_from.stderr
    assert by_init_from.stdout == by_out_dir.stdout and "\nTh" in by_out_dir.stdout
    data = tiny_run / ".." / "chars"
    flags = [f"--init_from={tiny_run}", "--device=cpu", f"--dataset={data.resolve()}", "--tasks=val", "--json=True"]
    evaluated = run_script("eval.py", *flags)
    assert evaluated.returncode == 0, evaluated.stderr
    assert '"val"' in evaluated.stdout.splitlines()[-1]


def test_a_run_without_a_chat_template_is_refused_by_name(tiny_run):
    model, spec = load.for_inference(str(tiny_run), None, report=lambda line: None)
    for init_from, out_dir in (("resume", str(tiny_run)), (str(tiny_run), None)):
        with pytest.raises(UserError, match=f"the model in {tiny_run} was not trained on conversations"):
            load.chat_template(model.config.vocab_size, spec, init_from, out_dir)


def test_a_name_that_is_no_source_gets_one_line(tmp_path):
    empty = tmp_path / "nothing-here"
    empty.mkdir()
    result = run_script("sample.py", f"--init_from={empty}", "--device=cpu", "--max_new_tokens=2")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(empty) in lines[0], result.stderr
