"""Tasks with a checker, for scripts/chat_rl.py and pass@k: problems (a prompt, its reference answer) split
into train and test, and reward(problem, completion), 1.0 when the checker accepts the
completion, else 0.0.

    from gpt.rl import tasks
    task = tasks.load("gsm8k", train_file="gsm8k/train.jsonl", test_file="gsm8k/test.jsonl")
    task = tasks.load("arithmetic", seed=0)                      # generated here, nothing to download
    task = tasks.load("jsonl", train_file="mine.jsonl", test_file="mine_test.jsonl", check="numeric")
    task.reward(task.test[0], "3 + 4 = 7\\n#### 7")             # 1.0

Three kinds, one interface:
    gsm8k       GSM8K's published jsonl: {"question": ..., "answer": "...#### 72"}, or without files
                openai/gsm8k from the Hugging Face hub where the network allows. The checker is
                nanochat's: the number after '####' (commas removed) in the completion equals the one
                in the reference answer, as text.
    arithmetic  word problems of one-digit numbers generated from a seed, in GSM8K's format and
                checked as GSM8K is, that a CPU-scale model learns in minutes: "Ava has 3 apples. She
                gets 4 more and gives 2 away. How many apples does Ava have now?" -> "3 + 4 - 2 = 5
                #### 5". A test problem's numbers (a, b, c) never occur in a train problem (one
                triple in ten is held out, by a hash of its numbers): pass@k measures arithmetic,
                not recall. data/chat/arithmetic.py writes the same problems as conversations for SFT.
    jsonl       your own: {"prompt": ..., "answer": ...} per line; check='exact' compares the
                completion, stripped, with the answer; check='numeric' the last number in the
                completion (commas removed) with the answer's, as numbers.
A bad line of a file stops with one line naming the file and its line number.
"""

import json
import random
import re
import zlib
from dataclasses import dataclass

from configurator import UserError

KINDS = ("arithmetic", "gsm8k", "jsonl")
GSM8K = "openai/gsm8k"  # on the Hugging Face hub, config 'main': train (7,473 problems) and test (1,319)
CHECKS = ("exact", "numeric")

# nanochat's tasks/gsm8k.py: the answer is the number after '#### ', commas removed
GSM_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
NUMBER_RE = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


@dataclass(frozen=True)
class Problem:
    prompt: str  # the user's message
    answer: str  # the reference: the number the checker compares with (gsm8k, arithmetic, numeric), or the text (exact)
    solution: str = ""  # a worked answer for SFT, when the task has one (GSM8K's, arithmetic's)


def gsm8k_answer(text):
    """The number after '#### ' in text, commas removed, or None: nanochat's extract_answer."""
    match = GSM_RE.search(text)
    return match.group(1).strip().replace(",", "") if match else None


def last_number(text):
    """The last number in text as a float, commas removed, or None."""
    found = NUMBER_RE.findall(text)
    try:
        return float(found[-1].replace(",", "")) if found else None
    except ValueError:  # "1,,": commas alone
        return None


class Task:
    """A task: its train and test problems and its checker (check: 'gsm8k', 'exact' or 'numeric')."""

    def __init__(self, name, train, test, check):
        self.name, self.train, self.test, self.check = name, train, test, check

    def reward(self, problem, completion):
        if self.check == "gsm8k":
            return float(gsm8k_answer(completion) == problem.answer)
        if self.check == "numeric":
            got = last_number(completion)
            return float(got is not None and got == float(problem.answer))
        return float(completion.strip() == problem.answer.strip())


def load(kind, train_file="", test_file="", check="exact", seed=0, n_train=5000, n_test=200):
    """The task of `kind` (KINDS): generated (arithmetic), or read from the jsonl files."""
    if kind == "arithmetic":
        return Task("arithmetic", arithmetic(n_train, seed, False), arithmetic(n_test, seed, True), "gsm8k")
    if kind == "gsm8k" and not train_file and not test_file:  # from the hub, where the network allows
        return Task(kind, read_gsm8k(f"{GSM8K}/train", hub("train")), read_gsm8k(f"{GSM8K}/test", hub("test")), kind)
    if not train_file or not test_file:
        raise UserError(f"task='{kind}' reads its problems from files: set --train_file and --test_file (jsonl)")
    read = read_gsm8k if kind == "gsm8k" else lambda path: read_jsonl(path, check)
    return Task(kind, read(train_file), read(test_file), "gsm8k" if kind == "gsm8k" else check)


# ---------------------------------------------------------------------------- files


def records(path):
    """(line number, dict) of each non-blank line of a jsonl file; a line that is not a JSON object is one UserError."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise UserError(f"cannot read the task file {path} ({e.strerror or e})")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg}); fix the line or remove it")
        if not isinstance(record, dict):
            raise UserError(f"{path}:{n}: not a JSON object; each line is one problem, {{...}}")
        out.append((n, record))
    if not out:
        raise UserError(f"{path} holds no problems")
    return out


def _text(path, n, record, key, example):
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{path}:{n}: no {key!r} text; each line is {example}")
    return value


def hub(split):
    """(row number, record) of GSM8K's split on the Hugging Face hub (needs the network)."""
    try:
        import datasets

        return list(enumerate(map(dict, datasets.load_dataset(GSM8K, "main", split=split)), 1))
    except Exception as e:  # no network, or the hub refused: its first line says which
        raise UserError(
            f"cannot read {GSM8K} ({split}) from the Hugging Face hub ({(str(e).strip() or type(e).__name__).splitlines()[0]}); "
            f"set --train_file and --test_file to GSM8K's jsonl files instead"
        ) from None


def read_gsm8k(path, rows=None):
    """GSM8K's jsonl (or rows read elsewhere, named by path): question, and an answer that ends in '#### N'."""
    example = '{"question": "...", "answer": "... #### 72"}'
    problems = []
    for n, record in records(path) if rows is None else rows:
        question, answer = (_text(path, n, record, key, example) for key in ("question", "answer"))
        number = gsm8k_answer(answer)
        if number is None:
            raise UserError(f"{path}:{n}: the answer has no '#### N' (GSM8K's final number); each line is {example}")
        problems.append(Problem(question, number, answer))
    return problems


def read_jsonl(path, check):
    """Your own jsonl: prompt and answer; with check='numeric' the answer must be a number."""
    example = '{"prompt": "...", "answer": "..."}'
    problems = []
    for n, record in records(path):
        prompt = _text(path, n, record, "prompt", example)
        answer = record.get("answer")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        answer = _text(path, n, {"answer": answer}, "answer", example)
        if check == "numeric" and last_number(answer) is None:
            raise UserError(f"{path}:{n}: the answer {answer!r} is not a number, which check='numeric' compares")
        if check == "numeric":
            answer = repr(last_number(answer))
        problems.append(Problem(prompt, answer, record["answer"] if isinstance(record["answer"], str) else answer))
    return problems


# ---------------------------------------------------------------------------- generated


NAMES = ("Ava", "Ben", "Mia", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eli", "Nora", "Omar", "Lily")
ITEMS = ("apples", "coins", "books", "shells", "stamps", "marbles", "cards", "pens", "eggs", "stones")
STORIES = (
    "{name} has {a} {item}. {name} gets {b} more and gives {c} away. How many {item} does {name} have now?",
    "There are {a} {item} in a box. {name} puts in {b} more, then takes out {c}. How many {item} are in the box?",
    "{name} found {a} {item} and then {b} more, but lost {c}. How many {item} does {name} have left?",
)


def held_out(a, b, c):
    """One triple of numbers in ten, fixed by the numbers: the test problems'."""
    return zlib.crc32(f"{a} {b} {c}".encode()) % 10 == 0


def arithmetic(n, seed, held_out_side):
    """n word problems a + b - c (a, b in 1..9, c in 0..9, the result >= 0) of one side of the
    held_out line, from `seed`: the same seed gives the same problems."""
    rng = random.Random(f"arithmetic {seed} {'test' if held_out_side else 'train'}")
    problems = []
    while len(problems) < n:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        c = rng.randint(0, min(9, a + b))
        if held_out(a, b, c) != held_out_side:
            continue
        story = rng.choice(STORIES).format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b, c=c)
        result = a + b - c
        problems.append(Problem(story, str(result), f"{a} + {b} - {c} = {result}\n#### {result}"))
    return problems
