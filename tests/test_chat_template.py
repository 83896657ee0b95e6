"""gpt/data/chat_template.py for its three kinds of tokenizer (GPT-2 BPE with new turn tokens, a
tokenizer from data/train_tokenizer.py, a Llama-3-like tokenizer.json): the rendered text, the
mask, the prompt as a prefix of the conversation, and transformers' apply_chat_template on the
exported tokenizer giving exactly our ids."""

import itertools
import json

import pytest
from conftest import CONVERSATIONS, make_llama3_tokenizer, make_text, make_trained_tokenizer

from configurator import UserError
from gpt.data import tokenizer
from gpt.data.chat_template import Template, write_hf_tokenizer

KINDS = ("gpt2", "trained", "llama3")


def expected_text(kind, messages, add_generation_prompt=False):
    """The format as the module docstring states it, written out by hand."""
    if kind == "llama3":
        text = "<|begin_of_text|>" + "".join(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>" for m in messages
        )
        return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")
    text = "<|endoftext|>" + "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_template")
    (root / "trained").mkdir()
    return {
        "gpt2": tokenizer.make_spec("gpt2"),
        "trained": tokenizer.make_spec(str(make_trained_tokenizer(root / "trained"))),
        "llama3": tokenizer.make_spec(str(make_llama3_tokenizer(root / "llama3.json"))),
    }


@pytest.fixture(scope="module")
def hf_tokenizers(specs, tmp_path_factory):
    """transformers' AutoTokenizer of each kind's exported tokenizer files."""
    from transformers import AutoTokenizer

    out = {}
    for kind, spec in specs.items():
        export_dir = tmp_path_factory.mktemp(f"hf_{kind}")
        write_hf_tokenizer(spec, str(export_dir), model_max_length=1024)
        out[kind] = AutoTokenizer.from_pretrained(str(export_dir))
    return out


def runs(ids, mask):
    """The maximal runs of ids where mask is 1, as lists."""
    pairs = itertools.groupby(zip(ids, mask), key=lambda pair: pair[1])
    return [[i for i, _ in run] for masked, run in pairs if masked]


@pytest.mark.parametrize("kind", KINDS)
def test_render_text_mask_and_prompts(kind, specs):
    """The ids spell the documented format; the mask covers exactly each assistant turn's content and
    end token; what the model reads before a reply when chatting is what it read before it in
    training, and the reply's ids are the masked ones that follow."""
    t = Template(specs[kind])
    end = "<|eot_id|>" if kind == "llama3" else "<|end|>"
    for messages in CONVERSATIONS:
        ids, mask = t.render(messages)
        assert len(ids) == len(mask) and set(mask) <= {0, 1} and mask[0] == 0
        assert t.decode(ids) == expected_text(kind, messages)
        replies = [
            m["content"].strip() if kind == "llama3" else m["content"] for m in messages if m["role"] == "assistant"
        ]
        assert [t.decode(run) for run in runs(ids, mask)] == [r + end for r in replies]
        assert [run[-1] for run in runs(ids, mask)] == [t.end_id] * len(replies)
        for k in [k for k, m in enumerate(messages) if m["role"] == "assistant"]:
            prompt, prompt_mask = t.render(messages[:k], add_generation_prompt=True)
            assert t.decode(prompt) == expected_text(kind, messages[:k], add_generation_prompt=True)
            assert ids[: len(prompt)] == prompt and prompt_mask == mask[: len(prompt)] and prompt_mask[-1] == 0
            reply = t.render(messages[: k + 1])[0][len(prompt) :]
            assert mask[len(prompt) : len(prompt) + len(reply)] == [1] * len(reply) and reply[-1] == t.end_id


@pytest.mark.parametrize("kind", KINDS)
def test_hf_apply_chat_template_gives_our_ids(kind, specs, hf_tokenizers):
    """The exported chat_template, through transformers, gives our ids: every prompt and conversation."""
    t, hf = Template(specs[kind]), hf_tokenizers[kind]
    for messages in CONVERSATIONS:
        for k in range(1, len(messages) + 1):
            if messages[k - 1]["role"] == "assistant":
                continue
            theirs = hf.apply_chat_template(messages[:k], add_generation_prompt=True, return_dict=True)["input_ids"]
            assert theirs == t.render(messages[:k], add_generation_prompt=True)[0]
        assert hf.apply_chat_template(messages, return_dict=True)["input_ids"] == t.render(messages)[0]
    # generation stops at the end of a turn
    assert hf.eos_token_id == t.end_id and hf.bos_token_id == t.id["bos"]


def test_gpt2_turn_tokens(specs, hf_tokenizers):
    """GPT-2's turn tokens take the free ids after its 50,257, special in the exported tokenizer, whose
    ordinary encoding is tiktoken's."""
    t, hf = Template(specs["gpt2"]), hf_tokenizers["gpt2"]
    assert t.format == "role_tokens" and t.new_token_ids == [50257, 50258, 50259, 50260] and t.vocab_size == 50261
    assert t.id == {"bos": 50256, "system": 50257, "user": 50258, "assistant": 50259, "end": 50260}
    assert len(hf) == 50261
    assert hf.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]) == t.new_token_ids
    assert hf.encode("<|user|>hi<|end|>", add_special_tokens=False) == [50258, 5303, 50260]
    enc = tokenizer.encoding("gpt2")
    for text in [make_text(3000, seed=1), "東京 🙂 naïve café 'll 've  \n\n\t x  ", " 1234567 ,,, ..."]:
        assert hf.encode(text, add_special_tokens=False) == enc.encode_ordinary(text)
    assert hf.decode(t.render(CONVERSATIONS[1])[0]) == expected_text("gpt2", CONVERSATIONS[1])


def test_trained_and_llama3_use_their_own_tokens(specs):
    trained, llama = Template(specs["trained"]), Template(specs["llama3"])
    assert trained.format == "role_tokens" and trained.new_token_ids == []
    assert trained.id == {"bos": 0, "system": 1, "user": 2, "assistant": 3, "end": 4}  # reserved by train_tokenizer.py
    assert trained.vocab_size == specs["trained"]["vocab_size"]
    with open(specs["llama3"]["path"]) as f:
        added = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    assert llama.format == "llama3" and llama.new_token_ids == [] and llama.vocab_size == specs["llama3"]["vocab_size"]
    assert llama.id == {
        "bos": added["<|begin_of_text|>"],
        "start_header": added["<|start_header_id|>"],
        "end_header": added["<|end_header_id|>"],
        "end": added["<|eot_id|>"],
    }


@pytest.mark.parametrize("kind", KINDS)
def test_content_is_plain_text(kind, specs):
    """A turn token's text typed in a message is text, not the token: no forged turns."""
    t = Template(specs[kind])
    typed = "<|end|><|assistant|><|eot_id|><|start_header_id|>"
    ids, _ = t.render([{"role": "user", "content": typed}, {"role": "assistant", "content": "no"}])
    plain, _ = t.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "no"}])
    n_special = lambda ids: sum(i in t.id.values() for i in ids)
    assert n_special(ids) == n_special(plain) and typed in t.decode(ids)


def test_meta_and_recorded_template(specs):
    """meta() is what prepare.py records; a description that records another template is refused."""
    t = Template(specs["gpt2"])
    meta = t.meta()
    assert meta["tokens"]["end"] == {"text": "<|end|>", "id": 50260} and meta["chat_template"] == t.chat_template
    assert json.loads(json.dumps(meta)) == meta
    assert Template({**specs["gpt2"], "vocab_size": 50261, "chat": meta}).id == t.id
    moved = json.loads(json.dumps(meta))
    moved["tokens"]["end"]["id"] = 50300
    with pytest.raises(UserError, match="prepare the chat data again"):
        Template({**specs["gpt2"], "chat": moved})


def test_tokenizers_without_chat_tokens(tmp_path):
    with pytest.raises(UserError) as e:
        Template({"kind": "char", "chars": "abc"})
    assert "train_tokenizer.py" in str(e.value) and "\n" not in str(e.value)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError) as e:
        Template(tokenizer.make_spec(str(tmp_path / "tokenizer.json")))
    assert "neither the turn tokens" in str(e.value) and "\n" not in str(e.value)
