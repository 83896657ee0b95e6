"""rl.py, the chat pipeline's RL stage: the tasks and their checkers (gpt/rl/tasks.py)."""

import json
import re

import pytest

from configurator import UserError
from gpt.rl import tasks

# GSM8K's published format: the worked answer, with its calculator annotations, ends in '#### N'
GSM8K_LINES = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "A farm has 1,200 hens and buys 34 more. How many hens does it have?",
        "answer": "1,200 + 34 = <<1200+34=1234>>1,234\n#### 1,234",
    },
    {"question": "It is 5 degrees and drops 8. What is the temperature?", "answer": "5 - 8 = -3\n#### -3"},
]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_gsm8k_checker_is_the_number_after_the_hashes_commas_removed(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_LINES)
    task = tasks.load("gsm8k", train_file=path, test_file=path)
    assert [p.answer for p in task.test] == ["72", "1234", "-3"]
    assert task.test[0].solution == GSM8K_LINES[0]["answer"]
    natalia, hens, cold = task.test
    for problem, completion, reward in [
        (natalia, GSM8K_LINES[0]["answer"], 1.0),  # the reference itself
        (natalia, "so 72 in all\n#### 72", 1.0),
        (natalia, "72", 0.0),  # no '####': nanochat's checker finds no answer
        (natalia, "#### 73", 0.0),
        (natalia, "#### 72.0", 0.0),  # compared as text, as nanochat does
        (hens, "#### 1,234", 1.0),  # commas removed on both sides
        (hens, "#### 1234 hens", 1.0),
        (hens, "#### 12,34", 1.0),  # nanochat's rule: every comma goes
        (cold, "#### -3", 1.0),
        (cold, "#### 3", 0.0),
    ]:
        assert task.reward(problem, completion) == reward, (problem.answer, completion)
    assert [tasks.gsm8k_answer(r["answer"]) for r in GSM8K_LINES] == ["72", "1234", "-3"]


def test_own_jsonl_checks_exactly_or_as_numbers(tmp_path):
    path = write_jsonl(
        tmp_path / "mine.jsonl", [{"prompt": "Capital of France?", "answer": "Paris"}, {"prompt": "2+2", "answer": 4}]
    )
    exact = tasks.load("jsonl", train_file=path, test_file=path, check="exact")
    assert [exact.reward(exact.test[0], c) for c in ("Paris", " Paris\n", "paris", "Paris.")] == [1, 1, 0, 0]
    numbers = write_jsonl(
        tmp_path / "n.jsonl", [{"prompt": "2+2", "answer": "4"}, {"prompt": "big", "answer": "1,000"}]
    )
    numeric = tasks.load("jsonl", train_file=numbers, test_file=numbers, check="numeric")
    four, thousand = numeric.test
    assert [numeric.reward(four, c) for c in ("4", "it is 4.0", "3 then 4", "4 then 3", "four")] == [1, 1, 1, 0, 0]
    assert [numeric.reward(thousand, c) for c in ("1,000", "1000", "100")] == [1, 1, 0]


def test_arithmetic_is_seeded_checked_as_gsm8k_and_holds_out_its_test_numbers():
    task = tasks.load("arithmetic", seed=3, n_train=300, n_test=40)
    again = tasks.load("arithmetic", seed=3, n_train=300, n_test=40)
    assert task.train == again.train and task.test == again.test
    assert task.train != tasks.load("arithmetic", seed=4, n_train=300, n_test=40).train
    numbers = lambda p: tuple(int(x) for x in re.findall(r"\d+", p.solution)[:3])
    train, test = {numbers(p) for p in task.train}, {numbers(p) for p in task.test}
    assert not train & test and len(test) > 10
    for p in task.train + task.test:
        a, b, c = numbers(p)
        assert p.answer == str(a + b - c) and int(p.answer) >= 0 and f"{a}" in p.prompt
        assert task.reward(p, p.solution) == 1.0 and task.reward(p, f"#### {int(p.answer) + 1}") == 0.0


@pytest.mark.parametrize(
    "kind, lines, said",
    [
        ("gsm8k", [GSM8K_LINES[0], "{not json", GSM8K_LINES[1]], ":2: not JSON"),
        (
            "gsm8k",
            [GSM8K_LINES[0], GSM8K_LINES[1], {"question": "q", "answer": "no number"}],
            ":3: the answer has no '#### N'",
        ),
        ("gsm8k", [{"question": "q"}], ":1: no 'answer' text"),
        ("jsonl", [{"prompt": "p", "answer": "a"}, "[1, 2]"], ":2: not a JSON object"),
        ("jsonl", [{"prompt": "p", "answer": "a"}, "", {"answer": "b"}], ":3: no 'prompt' text"),
        ("numeric", [{"prompt": "p", "answer": "seven"}], ":1: the answer 'seven' is not a number"),
    ],
)
def test_a_bad_task_line_is_named_by_its_number(tmp_path, kind, lines, said):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    check = "numeric" if kind == "numeric" else "exact"
    with pytest.raises(UserError, match=re.escape(f"{path}{said}")):
        tasks.load("gsm8k" if kind == "gsm8k" else "jsonl", train_file=path, test_file=path, check=check)
