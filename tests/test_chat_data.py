"""data/chat/prepare.py: the files it writes (tokens, masks, starts, meta.json) read back to the
conversations as Template.render gives them (its mask, the assistant's content and end: test_chat_template.py);
the bad-record catalogue, --skip_bad, long conversations and the val split."""

import json
from collections import Counter

import numpy as np
import pytest
from conftest import make_trained_tokenizer, one_line_error
from processes import load_script, run_script

from configurator import UserError
from gpt.data import token_files, tokenizer
from gpt.data.chat_template import Template

prepare = load_script("data/chat/prepare.py")
WORDS = ["apple", "river", "seven", "blue", "quiet", "東京", "🙂", "naïve", "stone", "light"]


def conversation(i):
    """Conversation i: some with a system prompt, one to three exchanges, lengths varying."""
    rng = np.random.default_rng(i)

    def words(n):
        return " ".join(rng.choice(WORDS, size=n))

    messages = [{"role": "system", "content": f"You are helper {i}."}] if i % 3 == 0 else []
    for turn in range(1 + i % 3):
        messages += [
            {"role": "user", "content": f"Question {turn}: {words(int(rng.integers(1, 6)))}?"},
            {"role": "assistant", "content": f"Answer {turn}: {words(int(rng.integers(1, 30)))}."},
        ]
    return {"messages": messages}


GOOD = [conversation(i) for i in range(40)]


def turns(*pairs):
    return {"messages": [{"role": role, "content": content} for role, content in pairs]}


NO_MESSAGES = 'no "messages" list (or an empty one)'
BAD = {  # the catalogue: a record as written in the file, the reason --skip_bad counts, what its message says
    "not JSON": ('{"messages": [oops', "not JSON", "not JSON (Expecting value: line 1 column 15 (char 14))"),
    "JSON but not an object": ([1, 2], "not JSON", "not a JSON object but list"),
    "no messages key": ({"text": "hello"}, "no messages", NO_MESSAGES),
    "empty messages": ({"messages": []}, "no messages", NO_MESSAGES),
    "message not an object": (
        {"messages": ["hi"]},
        "bad message",
        'message 1 is not {"role": "...", "content": "..."}',
    ),
    "unknown role": (
        turns(("user", "a"), ("tool", "b")),
        "unknown role",
        "message 2 has the unknown role 'tool' (roles: system, user, assistant)",
    ),
    "empty turn": (turns(("user", " \n"), ("assistant", "b")), "empty turn", "message 1 (user) is empty"),
    "system not first": (
        turns(("user", "a"), ("system", "b"), ("assistant", "c")),
        "system not first",
        "message 2 is a system message; only the first may be",
    ),
    "no assistant": (
        turns(("system", "a"), ("user", "b")),
        "no assistant turn",
        "no assistant turn: nothing to train on",
    ),
    "ends with the user": (
        turns(("user", "a"), ("assistant", "b"), ("user", "c")),
        "does not end with the assistant",
        "ends with a user turn, not the assistant's",
    ),
}


def write_jsonl(path, lines):
    texts = (line if isinstance(line, str) else json.dumps(line, ensure_ascii=False) for line in lines)
    path.write_text("".join(f"{text}\n" for text in texts), encoding="utf-8")
    return path


def read_split(data_dir, split):
    """[(ids, mask)] per conversation, cut at the starts."""
    ids = token_files.read(str(data_dir / f"{split}.bin"))
    mask = np.load(data_dir / f"{split}_mask.npy")
    starts = np.load(data_dir / f"{split}_starts.npy")
    assert mask.dtype == np.uint8 and starts.dtype == np.int64 and len(mask) == len(ids)
    assert starts[0] == 0 and (np.diff(starts) > 0).all() and starts[-1] < len(ids)
    bounds = [*starts, len(ids)]
    return [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_data")
    write_jsonl(root / "conv.jsonl", [GOOD[0], "", *GOOD[1:]])  # a blank line is no record
    assert prepare.main(["--input", str(root / "conv.jsonl"), f"--out_dir={root / 'data'}", "--val_frac=0.1"]) == 0
    return root / "data"


def test_files_read_back_to_the_conversations(prepared):
    """train + val hold every conversation once, each split in input order, val the seeded 10%;
    the token files, masks and starts cut back into each conversation's rendered ids and mask."""
    meta = json.loads((prepared / "meta.json").read_text())
    spec = tokenizer.describe(str(prepared))
    t = Template(spec)  # the recorded template is the one derived from the tokenizer
    assert spec["kind"] == "tiktoken" and spec["vocab_size"] == 50261 == t.vocab_size
    rendered = [tuple(t.render(c["messages"])[0]) for c in GOOD]
    train, val = read_split(prepared, "train"), read_split(prepared, "val")
    assert len(val) == 4 and len(train) == 36
    assert sorted(tuple(ids) for ids, _ in train + val) == sorted(rendered)
    for split in (train, val):
        order = [rendered.index(tuple(ids)) for ids, _ in split]
        assert order == sorted(order)
        for ids, mask in split:
            assert mask == t.render(GOOD[rendered.index(tuple(ids))]["messages"])[1]
    chat = meta["chat"]
    assert chat["format"] == "role_tokens" and chat["block_size"] == 1024
    assert chat["new_token_ids"] == [50257, 50258, 50259, 50260]
    assert chat["tokens"]["end"] == {"text": "<|end|>", "id": 50260} and chat["chat_template"] == t.chat_template
    for name, split in (("train", train), ("val", val)):
        counts = dict(conversations=len(split), tokens=sum(len(i) for i, _ in split), long=0, long_untrained_tokens=0)
        assert chat["counts"][name] == dict(counts, trained_tokens=sum(sum(m) for _, m in split))
        data = token_files.Tokens.open(str(prepared), name)  # what train.py opens
        assert data.dtype == np.uint16 and data.max_ids[0] <= 50260
        data.check_vocab(spec["vocab_size"])
    assert len(tokenizer.token_bytes(spec, offline=True)) == 50257  # bits per byte reads the description as it is


@pytest.mark.parametrize("case", list(BAD))
def test_bad_record_stops_with_file_and_line(case, tmp_path):
    """Each bad record: exit 2 with one line naming file:line (a blank line counts) and the problem, nothing written."""
    path = write_jsonl(tmp_path / "conv.jsonl", [GOOD[0], GOOD[1], "", BAD[case][0], GOOD[2]])
    result = run_script("data/chat/prepare.py", "--input", path, f"--out_dir={tmp_path / 'data'}")
    fix = "fix it, or pass --skip_bad=True to skip bad records"
    assert result.returncode == 2 and one_line_error(result) == f"error: {path}:4: {BAD[case][2]}; {fix}"
    assert not (tmp_path / "data").exists()


def test_skip_bad_counts_by_reason(tmp_path, capsys):
    lines = [GOOD[i] for i in range(10)] + [line for line, _, _ in BAD.values()] + [GOOD[10]]
    path = write_jsonl(tmp_path / "conv.jsonl", lines)
    assert prepare.main(["--input", str(path), f"--out_dir={tmp_path / 'data'}", "--skip_bad=True"]) == 0
    chat = json.loads((tmp_path / "data" / "meta.json").read_text())["chat"]
    assert chat["skipped"] == dict(Counter(reason for _, reason, _ in BAD.values()))
    assert sum(c["conversations"] for c in chat["counts"].values()) == 11
    assert f"skipped {len(BAD)} bad records: 2 not JSON, 2 no messages, 1 bad message" in capsys.readouterr().out


def test_long_conversations_are_reported_then_kept_or_dropped(tmp_path, capsys):
    """A conversation longer than block_size + 1 tokens is counted, with the trained tokens a row
    from its start cannot reach; --drop_long=True drops it, counted."""
    path = write_jsonl(tmp_path / "conv.jsonl", GOOD)
    t = Template(tokenizer.make_spec("gpt2"))
    renders = [t.render(c["messages"]) for c in GOOD]
    block_size = int(np.percentile([len(ids) for ids, _ in renders], 75))
    long = [mask for ids, mask in renders if len(ids) > block_size + 1]
    untrained = sum(sum(mask[block_size + 1 :]) for mask in long)
    assert 0 < len(long) < len(GOOD) - 4 and untrained > 0

    args = ["--input", str(path), f"--block_size={block_size}", "--val_frac=0.1"]
    assert prepare.main([*args, f"--out_dir={tmp_path / 'kept'}"]) == 0
    out = capsys.readouterr().out
    assert f"{len(long)} conversations (train " in out
    assert f"longer than block_size + 1 = {block_size + 1} tokens; kept" in out
    assert f"{untrained:,} of their trained tokens are never trained" in out
    counts = json.loads((tmp_path / "kept" / "meta.json").read_text())["chat"]["counts"]
    assert sum(c["long"] for c in counts.values()) == len(long)
    assert sum(c["long_untrained_tokens"] for c in counts.values()) == untrained
    assert sum(c["conversations"] for c in counts.values()) == len(GOOD)

    assert prepare.main([*args, f"--out_dir={tmp_path / 'dropped'}", "--drop_long=True"]) == 0
    assert "dropped (--drop_long=True)" in capsys.readouterr().out
    meta = json.loads((tmp_path / "dropped" / "meta.json").read_text())["chat"]
    assert sum(c["conversations"] for c in meta["counts"].values()) == len(GOOD) - len(long) and meta["drop_long"]
    for split in ("train", "val"):
        assert all(len(ids) <= block_size + 1 for ids, _ in read_split(tmp_path / "dropped", split))


def test_val_input_and_a_trained_tokenizer(tmp_path):
    """--val_input is val as it is; a tokenizer.json from data/train_tokenizer.py takes its own
    reserved tokens (uint16 ids, no new ones)."""
    (tmp_path / "tok").mkdir()
    tok = f"--tokenizer={make_trained_tokenizer(tmp_path / 'tok')}"
    write_jsonl(tmp_path / "train.jsonl", GOOD[:30])
    write_jsonl(tmp_path / "val.jsonl", GOOD[30:])
    files = ["--input", str(tmp_path / "train.jsonl"), "--val_input", str(tmp_path / "val.jsonl")]
    assert prepare.main([*files, tok, f"--out_dir={tmp_path / 'data'}"]) == 0
    spec = tokenizer.describe(str(tmp_path / "data"))
    t = Template(spec)
    assert spec["chat"]["new_token_ids"] == [] and t.id["end"] == 4
    assert [ids for ids, _ in read_split(tmp_path / "data", "val")] == [t.render(c["messages"])[0] for c in GOOD[30:]]
    assert [ids for ids, _ in read_split(tmp_path / "data", "train")] == [t.render(c["messages"])[0] for c in GOOD[:30]]


def test_argument_errors(tmp_path):
    path = write_jsonl(tmp_path / "conv.jsonl", GOOD[:1])
    out = f"--out_dir={tmp_path / 'data'}"
    cases = [
        ([out], "exactly one source"),
        (["--input", str(path), "--dataset=a/b", out], "exactly one source"),
        (["--input", str(path), "--val_split=test", out], "--val_split with --dataset"),
        (["--input", str(path), "--val_frac=1", out], "--val_frac=1.0 must be in (0, 1)"),
        (["--input", str(path), out], "1 good conversation(s): too few"),
        (["--input", str(tmp_path / "nope.jsonl"), out], "does not exist"),
        (["--input", str(path), "--skip_bad=maybe", out], "not True or False"),
        (["--input", str(path), "--tokenizer=nope.json", out], "not found"),
    ]
    for argv, message in cases:
        with pytest.raises(UserError) as e:
            prepare.main(argv)
        assert message in str(e.value) and "\n" not in str(e.value), argv


@pytest.mark.process
def test_hub_dataset_without_the_hub(tmp_path):
    """--dataset with the Hub out of reach: one line naming the dataset, and the way out."""
    args = ["--dataset=HuggingFaceTB/smol-smoltalk", "--val_split=test", f"--out_dir={tmp_path / 'data'}"]
    # datasets reads HF_HUB_OFFLINE when it is imported
    result = run_script("data/chat/prepare.py", *args, env={"HF_HUB_OFFLINE": "1"}, isolated=True)
    line = one_line_error(result)
    assert result.returncode == 2
    assert line.startswith("error: cannot read HuggingFaceTB/smol-smoltalk (name=None, split=train)")
    assert line.endswith("pass local files with --input") and not (tmp_path / "data").exists()
