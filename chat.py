"""Talk to a chat model: a checkpoint fine-tuned on conversations (data/chat/prepare.py, then
train.py), or a Llama 3.2 Instruct directory.

    python chat.py --out_dir=out-chat-demo                                        # chat
    python chat.py --out_dir=out-chat-demo --prompt="Reverse: sule bo kire" --temperature=0   # one reply, for scripts
    python chat.py --out_dir=out-sft-gpt2 --system="You are a concise assistant." --temperature=0.7 --top_p=0.9
    python chat.py --init_from=Llama-3.2-1B-Instruct --context=4096               # a Hugging Face directory
    printf 'My name is Dovaki.\\nWhat is my name?\\n' | python chat.py --out_dir=out-chat-demo --temperature=0
    python chat.py --help

Type a message and the reply streams back token by token. /clear forgets the conversation (the
system message stays), /exit or Ctrl-D ends the chat, Ctrl-C stops a reply; a blank line does
nothing. With stdin not a terminal each line is a message and only the replies are printed, one
after the other. --prompt=TEXT prints the one reply to TEXT on stdout, nothing else, and exits.

The conversation is rendered by the chat template the model was trained with (gpt/data/chat_template.py),
and a reply ends at the end-of-turn token. The model reads each token once: the key/value cache is
kept across turns, so a turn runs only its own tokens (the user's message and the reply), never
the history again. When the conversation reaches the context (--context, default the model's
block_size), the oldest exchanges are dropped until it fills at most half of it, the system
message stays, and what is left is read again once, with a note on stderr.
"""

import contextlib
import sys
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from configurator import UserError, parse, require, require_choices, require_init_from, require_sampling, run_main
from gpt.data import tokenizer
from gpt.device import cpu_matmuls, runtime
from gpt.inference import sampling
from gpt.inference.sampling import KVCache
from gpt.weights.load import chat_template, for_inference


@dataclass
class ChatConfig:
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    init_from: str = "resume"  # 'resume' (a chat checkpoint from out_dir), or a Hugging Face Llama directory with Llama 3's chat tokens (Llama 3.2 Instruct) or a GPT-2 one exported by hf.py from a chat checkpoint
    out_dir: str = "out"  # where the checkpoint is
    checkpoint: Literal["best", "latest"] = "best"  # 'best' (ckpt_best.pt or ckpt_best/ when present) or 'latest' (ckpt.pt or the newest ckpt_<iter>/)
    system: str = ""  # the system message, kept when old exchanges are dropped; '': none
    prompt: Optional[str] = None  # one user message: print the reply alone on stdout and exit (for scripts); None: chat
    max_new_tokens: int = 512  # the longest reply, in tokens
    context: int = 0  # tokens of conversation the model reads at most (the KV cache's size); 0: block_size, at most 8192
    temperature: float = 0.7  # <1 sharper, >1 more random; 0 is greedy (always the most likely token)
    top_k: Optional[int] = None  # keep only the k most likely tokens; None keeps all
    top_p: float = 0.9  # nucleus: keep the most likely tokens until their probabilities add up to top_p; 1.0 keeps all
    seed: int = 1337  # the same seed gives the same replies to the same messages
    device: str = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype: str = "auto"  # 'auto', 'float32', 'bfloat16', 'float16'
    compile: bool = False  # torch.compile the model
    engine: Literal["process", "thread"] = "process"  # where the model runs: 'process' (its own, beside the server's: the two use two cores) or 'thread' (serve.py's own)
    # fmt: on

    def __post_init__(self):
        require_choices(self)
        require_init_from(self.init_from, ("resume",))
        require(
            self.prompt is None or self.prompt.strip(),
            "--prompt is empty; give the user's message, or leave it out to chat",
        )
        require(self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be at least 1")
        require(self.context >= 0, f"context={self.context} must be >= 0 (0: the model's block_size)")
        require_sampling(self)


MAX_CONTEXT = 8192  # context=0 takes the model's block_size up to this: Llama 3.2's 131072 would be an 8 GB cache


class Conversation:
    """What the model has read, as token ids: the head (the first token, and the system message),
    then one list per exchange (the user's turn, the assistant's header, the reply, its end
    token), and the key/value cache of as many of those ids as the model has run."""

    def __init__(self, model, template, system, context, device):
        self.model, self.template, self.context, self.device = model, template, context, device
        self.head = template.render([{"role": "system", "content": system}] if system else [])[0]
        self.exchanges = []
        self.cache = KVCache(model.config, 1, context)
        self.start = len(template.render([])[0])  # a turn's ids follow the first token(s)
        if len(self.head) >= context:
            raise UserError(
                f"the system message is {len(self.head)} tokens, too long for the context of {context}; "
                f"shorten it or raise --context"
            )

    @property
    def ids(self):
        return self.head + [i for exchange in self.exchanges for i in exchange]

    def clear(self):
        self.exchanges = []
        self.cache.length = min(self.cache.length, len(self.head))  # the head's keys stay valid

    def user_turn(self, text):
        """The ids a user message adds, up to the assistant's header: the template renders each
        turn on its own, so they are the same after any conversation."""
        return self.template.render([{"role": "user", "content": text}], add_generation_prompt=True)[0][self.start :]

    def drop_oldest(self, pending):
        """Drop the oldest exchanges until the conversation and `pending` (the turn under way) fill
        at most half the context; positions move, so the cache keeps only the head."""
        n = 0
        while self.exchanges and len(self.ids) + pending > self.context // 2:
            self.exchanges.pop(0)
            n += 1
        self.cache.length = min(self.cache.length, len(self.head))
        print(
            f"note: the conversation reached the context of {self.context} tokens: dropped the {n} oldest "
            f"exchange(s), the system message stays; the model reads the remaining {len(self.ids) + pending} "
            f"tokens again",
            file=sys.stderr,
            flush=True,
        )

    def reply(self, text, cfg, write):
        """The model's reply to the user's message `text`, its text passed to write as it is
        generated; the exchange joins the conversation, also when a Ctrl-C cuts it short."""
        new = self.user_turn(text)
        if len(self.head) + len(new) >= self.context:
            raise UserError(
                f"the message is {len(new)} tokens: with the system message it leaves no room for a reply "
                f"in the context of {self.context} tokens; shorten it"
            )
        end = self.template.end_id
        reply, stream = [], tokenizer.TextStream(self.template.decode, write)
        try:
            while len(reply) < cfg.max_new_tokens and reply[-1:] != [end]:
                pending = len(new) + len(reply)
                if len(self.ids) + pending >= self.context:
                    if not self.exchanges:
                        print(
                            f"\nnote: the reply filled the context of {self.context} tokens and was cut there",
                            file=sys.stderr,
                            flush=True,
                        )
                        break
                    self.drop_oldest(pending)
                    continue
                idx = torch.tensor([self.ids + new + reply], device=self.device)
                room = self.context - idx.size(1) + 1  # the last new token is not run, so it needs no room
                for token in sampling.generate_tokens(
                    self.model,
                    idx,
                    min(cfg.max_new_tokens - len(reply), room),
                    cfg.temperature,
                    cfg.top_k,
                    cfg.top_p,
                    stop_token=end,
                    cache=self.cache,
                ):
                    reply.append(token.item())
                    stream.update(reply[:-1] if reply[-1] == end else reply)
        finally:
            done = reply[:-1] if reply[-1:] == [end] else reply
            self.exchanges.append(new + done + [end])  # a cut reply still ends its turn, as in training
            stream.update(done, final=True)
        return self.template.decode(done)


def load(cfg, rt, say):
    """(model, template) of a chat checkpoint or a Hugging Face directory with a chat template."""
    loaded = []  # said once the model is known to chat
    model, tok_spec = for_inference(cfg.init_from, cfg.out_dir, cfg.checkpoint, report=loaded.append)
    template = chat_template(model.config.vocab_size, tok_spec, cfg.init_from, cfg.out_dir)
    if cfg.context > model.config.block_size:
        raise UserError(f"context={cfg.context} is longer than the model's block_size={model.config.block_size}")
    for line in loaded:
        say(line)
    cpu_matmuls.onednn_matmuls(model)  # as serve.py's: the same greedy replies
    return model.eval().to(rt.device), template


def read_lines(interactive):
    """The user's lines: typed at a '> ' prompt (with line editing), or read from a pipe."""
    if not interactive:
        yield from (line.rstrip("\n") for line in sys.stdin)
        return
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 (input() gets history and line editing)
    while True:
        try:
            yield input("> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt: the end
            print(file=sys.stderr)
            return


def repl(conv, cfg, rt):
    interactive = sys.stdin.isatty()
    if interactive:
        print("/clear forgets the conversation, /exit or Ctrl-D ends it, Ctrl-C stops a reply", file=sys.stderr)
    write = lambda text: (sys.stdout.write(text), sys.stdout.flush())
    for line in read_lines(interactive):
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/clear":
            conv.clear()
            print("(the conversation is cleared)", file=sys.stderr)
            continue
        if text.startswith("/") and " " not in text:  # a mistyped command is not a message
            print(f"unknown command {text}: /clear forgets the conversation, /exit ends it", file=sys.stderr)
            continue
        try:
            with rt.autocast():
                conv.reply(text, cfg, write)
        except KeyboardInterrupt:
            print("\n(stopped)", file=sys.stderr, end="")
        except UserError as e:  # a message too long: say so and go on
            print(f"error: {e}", file=sys.stderr)
            continue
        print("\n" if interactive else "", flush=True)


def main(argv=None):
    cfg = parse(ChatConfig, argv)
    rt = runtime.setup(cfg.device, cfg.dtype)
    say = (lambda text: None) if cfg.prompt is not None else (lambda text: print(text, file=sys.stderr))
    model, template = load(cfg, rt, say)
    if cfg.compile:
        model.compile()  # in place, so generate's calls to the model run the compiled forward
    conv = Conversation(
        model, template, cfg.system, cfg.context or min(model.config.block_size, MAX_CONTEXT), rt.device
    )
    torch.manual_seed(cfg.seed)
    if cfg.prompt is None:
        repl(conv, cfg, rt)
        return 0
    with rt.autocast():
        conv.reply(cfg.prompt, cfg, lambda text: sys.stdout.write(text))
    print()
    return 0


if __name__ == "__main__":
    run_main(main)
