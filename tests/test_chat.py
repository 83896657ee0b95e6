"""chat.py and the chat export: the KV cache across turns, the chat demo's model (conftest's
shared_chat_demo) through --prompt and the REPL, and hf.py's export against transformers."""

import json

import pytest
import torch
from conftest import (
    TINY,
    TINY_LLAMA,
    chat,
    chat_demo_copy,
    check_export,
    make_llama3_tokenizer,
    one_line_error,
    save_chat_checkpoint,
)
from processes import REPO, load_script, run_script

from configurator import TrainConfig, parse
from gpt.data import tokenizer
from gpt.data.chat_template import Template
from gpt.inference.sampling import KVCache, generate, generate_tokens
from gpt.outdir import checkpoint
from model import GPT, GPTConfig

SMALL, LLAMA = dict(TINY, block_size=128), dict(TINY_LLAMA, block_size=128)


# ---------------------------------------------------------------------------- the cache across turns


@pytest.mark.parametrize("shape", [SMALL, LLAMA], ids=["gpt2", "llama"])
def test_a_carried_cache_generates_what_the_whole_history_does(shape):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(shape, vocab_size=50))).eval()
    history = torch.randint(0, 50, (1, 7))
    cache = KVCache(model.config, 1, 64)
    for turn in range(4):
        theirs = generate(model, history, 6, temperature=0, kv_cache=False)[:, history.size(1) :]
        ours = torch.cat(list(generate_tokens(model, history, 6, temperature=0, cache=cache)), dim=1)
        assert torch.equal(ours, theirs)
        assert cache.length == history.size(1) + 5  # every token given to the model: all but the last new one
        history = torch.cat([history, ours, torch.randint(0, 50, (1, 3 + turn))], dim=1)  # the user's next turn

    cache = KVCache(model.config, 1, 64)
    with torch.no_grad():
        model(history[:, :10], cache=cache)
        chunk, _ = model(history[:, 10:], cache=cache, logits_at="all")
        full, _ = model(history, logits_at="all")
    torch.testing.assert_close(chunk, full[:, 10:], rtol=1e-5, atol=1e-5)


def test_stream_holds_back_a_character_until_its_last_byte():
    """GPT-2 BPE splits 🙂 and 東 into byte tokens."""
    template = Template(tokenizer.make_spec("gpt2"))
    text = "Hi 🙂 東京 naïve!"
    ids = tokenizer.encoding("gpt2").encode(text)
    pieces = []
    stream = tokenizer.TextStream(template.decode, pieces.append)
    for n in range(1, len(ids) + 1):
        stream.update(ids[:n], final=n == len(ids))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(pieces) < len(ids)  # some tokens showed nothing on their own


# ---------------------------------------------------------------------------- the synthetic task


def test_synthetic_held_out_conversations_use_unseen_words(tmp_path):
    synthetic = load_script("data/chat/synthetic.py")
    synthetic.main([f"--out_dir={tmp_path}", "--n=3000", "--n_heldout=40", "--seed=3"])
    read = lambda name: [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
    train, heldout = read("train.jsonl"), read("heldout.jsonl")
    train_text = (tmp_path / "text.txt").read_text()
    assert train_text.splitlines() == [m["content"] for c in train for m in c["messages"]]
    words = lambda text: {w.strip(".,!?:").lower() for w in text.split()}
    templates = " ".join(synthetic.GREETINGS + synthetic.RECALLS + synthetic.SYSTEMS)
    fixed = words(templates + " Nice to meet you, Your name is Repeat after me: Reverse:")
    held = set().union(*(words(m["content"]) for c in heldout for m in c["messages"])) - fixed
    assert len(held) > 60 and all(synthetic.held_out(w) for w in held)
    assert not held & words(train_text) and not any(synthetic.held_out(w) for w in words(train_text) - fixed)
    for c in heldout:
        (*_, user), reply = [m["content"] for m in c["messages"] if m["role"] == "user"], c["messages"][-1]["content"]
        if c["intent"] == "reverse":
            assert reply.split() == user.removeprefix("Reverse: ").split()[::-1]
        if c["intent"] == "recall":
            assert reply.removeprefix("Your name is ").rstrip(".") in c["messages"][-3]["content"]
    assert {c["intent"] for c in heldout} == set(synthetic.INTENTS)


@pytest.mark.slow
def test_the_demo_model_answers_held_out_prompts(shared_chat_demo):
    """Untrained, every answer is wrong; the 180 steps here get about two in three right (the demo's
    1,200 steps: 96.5%, BENCHMARKS.md, "The chat demo on a CPU")."""
    eval_script = load_script("scripts/chat_eval.py")
    out_dir, heldout = shared_chat_demo

    def ask(args, stdin):
        return chat(out_dir, *args, stdin=stdin).stdout

    right, asked, misses = eval_script.score(heldout, eval_script.ask_all(heldout, ask))
    assert sum(asked.values()) == 48 and set(asked) == {"greet", "repeat", "reverse", "recall"}
    assert sum(right.values()) >= 0.5 * 48, (right, misses[:5])
    assert right["greet"] >= 10 and right["recall"] >= 6, right


@pytest.mark.slow
def test_repl_clear_blank_lines_and_exit(shared_chat_demo):
    out_dir, _ = shared_chat_demo
    lines = "My name is Zuvaki.\n\nWhat is my name?\n/clera\n/clear\nWhat is my name?\n/exit\nRepeat after me: never asked\n"
    result = chat(out_dir, "--temperature=0", stdin=lines)
    replies = result.stdout.split("\n")
    # three replies: the blank line, /clera and what follows /exit ask nothing
    assert len(replies) == 4 and replies[-1] == ""
    fresh = chat(out_dir, "--temperature=0", "--prompt=What is my name?").stdout
    assert replies[0] == "Nice to meet you, Zuvaki!" and replies[2] + "\n" == fresh != replies[1] + "\n"
    assert "cleared" in result.stderr and "unknown command /clera" in result.stderr


@pytest.mark.slow
def test_the_checkpoint_is_read_on_the_cpu_and_only_the_model_moved(shared_chat_demo, monkeypatch):
    """'meta' stands in for a GPU here."""
    chat_py = load_script("chat.py")
    out_dir, _ = shared_chat_demo
    read, load_model = [], checkpoint.load_model

    def recorded(*args, **kwargs):
        read.append(kwargs.get("map_location", "cpu"))
        return load_model(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "load_model", recorded)
    cfg = parse(chat_py.ChatConfig, [f"--out_dir={out_dir}"])
    model, _ = chat_py.load(cfg, chat_py.runtime.Runtime("meta", "cuda", torch.float32), lambda text: None)
    assert read == ["cpu"] and {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.slow
def test_the_conversation_past_its_context(shared_chat_demo, capsys):
    chat_py = load_script("chat.py")
    out_dir, _ = shared_chat_demo
    cfg = parse(chat_py.ChatConfig, [f"--out_dir={out_dir}", "--temperature=0", "--max_new_tokens=20"])
    model, template = chat_py.load(cfg, chat_py.runtime.setup("cpu"), lambda text: None)
    conv = chat_py.Conversation(model, template, "Answer briefly.", 64, "cpu")
    head, notes = list(conv.head), 0
    messages = ["My name is Dovaki.", "Repeat after me: sule pova", "Reverse: kire sule"]
    messages += ["Repeat after me: pova kire", "Who am I?", "Reverse: sule pova kire"]
    for message in messages:
        conv.reply(message, cfg, lambda text: None)
        ids = conv.ids
        assert len(ids) <= 64 + 1 and ids[: len(head)] == head and ids[-1] == template.end_id
        fresh = KVCache(model.config, 1, 64)
        with torch.no_grad():
            model(torch.tensor([ids[: conv.cache.length]]), cache=fresh)
        torch.testing.assert_close(
            conv.cache.k[:, :, :, : fresh.length], fresh.k[:, :, :, : fresh.length], rtol=1e-5, atol=1e-6
        )
        # not the last token generated, nor an end token added to a cut reply
        assert len(ids) - 2 <= conv.cache.length < len(ids)
        notes += capsys.readouterr().err.count("dropped the")
    assert notes >= 2 and len(conv.exchanges) < 6


# ---------------------------------------------------------------------------- errors


@pytest.mark.slow
def test_errors_are_one_line(shared_chat_demo, tiny_run, tmp_path):
    out_dir, _ = shared_chat_demo
    plain = tiny_run  # a character model trained on plain text
    cases = [
        ([f"--out_dir={plain}"], "fine-tune it on chat data first"),
        ([f"--out_dir={out_dir}", "--temperature=-1"], "temperature=-1"),
        ([f"--out_dir={out_dir}", "--top_p=0"], "top_p=0"),
        ([f"--out_dir={out_dir}", "--prompt= "], "--prompt is empty"),
        ([f"--out_dir={out_dir}", "--context=4096"], "longer than the model's block_size=128"),
        ([f"--out_dir={out_dir}", "--prompt=" + "Repeat after me: sule " * 60], "shorten it"),
        ([f"--out_dir={out_dir}", "--tempreature=0"], "did you mean temperature"),
        ([f"--out_dir={tmp_path / 'nothing'}"], "does not exist"),
    ]
    for args, message in cases:
        result = run_script("chat.py", *args, "--device=cpu")
        assert result.returncode == 2 and result.stdout == "", (args, result.stdout)
        one_line_error(result, message)


def test_configs_parse():
    demo_cfg = parse(TrainConfig, [str(REPO / "config/chat_demo_cpu.py")])
    assert demo_cfg.dataset == "chat_demo" and demo_cfg.device == "cpu"
    sft = parse(TrainConfig, [str(REPO / "config/sft_gpt2_smoltalk.py")])
    tokens_per_step = sft.batch_size * sft.block_size * sft.gradient_accumulation_steps
    assert sft.init_from == "gpt2" and sft.block_size == 1024 and 64_000 <= tokens_per_step <= 131_072
    assert 1e-5 <= sft.learning_rate <= 5e-5


# ---------------------------------------------------------------------------- export


@pytest.mark.slow
def test_export_gpt2_with_a_trained_tokenizer(shared_chat_demo, tmp_path):
    out_dir, _ = chat_demo_copy(shared_chat_demo, tmp_path / "out")  # a copy to export into
    export_dir = check_export(out_dir, 40, expect_end=True)
    config = json.loads((export_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in config and config["eos_token"] == "<|end|>"


@pytest.mark.parametrize("arch", ["gpt2-bpe", "llama"])
def test_an_export_chats_as_its_checkpoint_does(arch, tmp_path):
    if arch == "llama":
        spec = tokenizer.make_spec(str(make_llama3_tokenizer(tmp_path / "tokenizer.json")))
        shape, exported = dict(LLAMA, vocab_size=spec["vocab_size"]), {"architectures": ["LlamaForCausalLM"]}
    else:
        spec = tokenizer.make_spec("gpt2")
        shape, exported = dict(SMALL, vocab_size=50261), {"vocab_size": 50261}
    torch.manual_seed(0)
    out_dir = save_chat_checkpoint(tmp_path / "out", GPT(GPTConfig(**shape)), spec)
    config = json.loads((check_export(out_dir, 12) / "config.json").read_text())
    assert all(config[key] == value for key, value in exported.items()), config
    check_export(out_dir, 12, init_from_export=True)
