"""Sample from a trained model: with a key/value cache, reproducible under a seed, streamed
to a terminal, tokens/s on stderr at the end.

    python sample.py --out_dir=out-shakespeare-char
    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=200
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt --temperature=0.6 --top_k=50
    python sample.py --out_dir=out-shakespeare-char --prompts_file=prompts.txt --top_k=None --top_p=0.9
    python sample.py --out_dir=out-shakespeare-char --temperature=0 --max_new_tokens=2000 --window_shift=1  # nanoGPT's exact context
    python sample.py --init_from=gpt2 --start="Hello, I'm a language model,"   # released GPT-2 (transformers)
    python sample.py --help

Each sample is printed as its prompt and continuation, then a line of dashes. The
num_samples samples of a prompt are generated together, as one batch.
"""

import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from configurator import UserError, parse, require, require_choices, require_init_from, require_sampling, run_main
from gpt.data import tokenizer
from gpt.device import cpu_matmuls, runtime
from gpt.inference import sampling
from gpt.weights import load


@dataclass
class SampleConfig:
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    init_from: str = "resume"  # 'resume' (a checkpoint from out_dir), 'gpt2'/'gpt2-medium'/'gpt2-large'/'gpt2-xl', a Hugging Face GPT-2 or Llama directory, or another run's out_dir
    out_dir: str = "out"  # where the checkpoint is
    checkpoint: Literal["best", "latest"] = "best"  # 'best' (ckpt_best.pt or ckpt_best/ when present) or 'latest' (ckpt.pt or the newest ckpt_<iter>/)
    start: str = "\n"  # the prompt, or FILE:path to read it from a file
    prompts_file: Optional[str] = None  # a file of prompts, one per line (blank lines skipped); replaces start
    num_samples: int = 10  # samples per prompt, generated together as one batch
    max_new_tokens: int = 500  # tokens generated per sample
    temperature: float = 0.8  # <1 sharper, >1 more random; 0 is greedy (always the most likely token)
    top_k: Optional[int] = 200  # keep only the k most likely tokens; None keeps all
    top_p: float = 1.0  # nucleus: keep the most likely tokens until their probabilities add up to top_p; 1.0 keeps all
    stop_at_eot: bool = True  # BPE models: end a sample at <|endoftext|>; False generates through it
    seed: int = 1337  # the same seed gives the same samples
    kv_cache: bool = True  # reuse each token's keys/values instead of recomputing the whole context per token
    window_shift: Optional[int] = None  # once the context is full, slide it this many tokens at once; None: block_size // 8; 1: nanoGPT's exact last-block_size context (slow)
    stream: Optional[bool] = None  # print tokens as they come; None: only when stdout is a terminal
    device: str = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype: str = "auto"  # 'auto', 'float32', 'bfloat16', 'float16'
    compile: bool = False  # torch.compile the model
    engine: Literal["process", "thread"] = "process"  # where the model runs: 'process' (its own, beside the server's: the two use two cores) or 'thread' (serve.py's own)
    # fmt: on

    def __post_init__(self):
        require_choices(self)
        require_init_from(self.init_from, ("resume",))
        require(self.num_samples >= 1 and self.max_new_tokens >= 1, "num_samples and max_new_tokens must be at least 1")
        require_sampling(self)
        require(
            self.window_shift is None or self.window_shift >= 1,
            f"window_shift={self.window_shift} must be at least 1, or None",
        )


SEPARATOR = "---------------"


def read_text(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise UserError(f"cannot read the {what} {path} ({e.strerror})")
    except UnicodeDecodeError:
        raise UserError(f"the {what} {path} is not UTF-8 text")


def read_prompts(cfg):
    """The prompt texts: each non-blank line of prompts_file, else start (FILE:path: a whole file)."""
    if cfg.prompts_file is not None:
        prompts = [line for line in read_text(cfg.prompts_file, "prompts file").splitlines() if line.strip()]
        if not prompts:
            raise UserError(f"the prompts file {cfg.prompts_file} has no prompts; write one per line")
        return prompts
    if cfg.start.startswith("FILE:"):
        return [read_text(cfg.start[len("FILE:") :], "prompt file")]
    return [cfg.start]


def encode_prompt(text, encode, eot, block_size):
    ids = encode(text)
    if not ids:
        if eot is None:
            raise UserError("the prompt is empty; give --start some text (the default is a newline)")
        ids = [eot]  # GPT-2 saw <|endoftext|> before every document: an empty prompt starts a new one
    if len(ids) > block_size:
        print(
            f"note: the prompt is {len(ids)} tokens, more than block_size={block_size}; "
            f"the model sees only the last {block_size}",
            file=sys.stderr,
        )
    return ids


def until(ids, stop):
    return ids[: ids.index(stop)] if stop is not None and stop in ids else ids


def sample_prompt(model, cfg, ids, stop, device, stream=None):
    """num_samples continuations of ids, generated as one batch: (lists of new token ids
    cut before stop, tokens generated). stream, if given, is fed the first one as it grows."""
    x = torch.tensor([ids] * cfg.num_samples, dtype=torch.long, device=device)  # (num_samples, T)
    rows = [[] for _ in range(cfg.num_samples)]
    steps = sampling.generate_tokens(
        model,
        x,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_k,
        top_p=cfg.top_p,
        kv_cache=cfg.kv_cache,
        window_shift=cfg.window_shift,
        stop_token=stop,
    )
    for next_id in steps:
        for row, token in zip(rows, next_id[:, 0].tolist()):
            row.append(token)
        if stream:
            stream.update(until(rows[0], stop))
    return [until(row, stop) for row in rows], len(rows[0]) * len(rows)


def main(argv=None):
    cfg = parse(SampleConfig, argv)
    if cfg.temperature == 0 and cfg.num_samples > 1:
        print(
            f"note: temperature=0 is greedy: the {cfg.num_samples} samples of a prompt are one text; "
            f"--num_samples=1 draws it once",
            file=sys.stderr,
        )
    rt = runtime.setup(cfg.device, cfg.dtype)
    model, tok_spec = load.for_inference(cfg.init_from, cfg.out_dir, cfg.checkpoint)
    model.eval().to(rt.device)
    cpu_matmuls.onednn_matmuls(model)  # on a CPU not Intel's, faster eager matmuls
    block_size = model.config.block_size
    if cfg.window_shift is not None and cfg.window_shift >= block_size:
        raise UserError(f"window_shift={cfg.window_shift} must be less than this model's block_size={block_size}")
    if cfg.compile:
        model.compile()  # in place, so generate's calls to the model run the compiled forward
    encode, decode = tokenizer.load(tok_spec)
    eot = tokenizer.eot(tok_spec)
    stop = eot if cfg.stop_at_eot else None
    prompts = [(text, encode_prompt(text, encode, eot, block_size)) for text in read_prompts(cfg)]
    streaming = sys.stdout.isatty() if cfg.stream is None else cfg.stream

    torch.manual_seed(cfg.seed)
    t0, n_tokens = time.perf_counter(), 0
    with rt.autocast():
        for text, ids in prompts:
            # the prompt's own text, not its ids decoded: the same for char models, and for BPE
            # it leaves out the <|endoftext|> an empty prompt starts from
            stream = None
            if streaming:
                sys.stdout.write(text)
                stream = tokenizer.TextStream(decode, lambda text: (sys.stdout.write(text), sys.stdout.flush()))
            samples, n = sample_prompt(model, cfg, ids, stop, rt.device, stream)
            n_tokens += n
            for i, new in enumerate(samples):
                full = text + decode(new)
                print(full[len(text) + len(stream.shown) :] if stream and i == 0 else full)
                print(SEPARATOR, flush=True)
    runtime.synchronize(rt)
    seconds = time.perf_counter() - t0
    print(
        f"{n_tokens} tokens in {seconds:.2f} s: {n_tokens / seconds:.1f} tokens/s "
        f"({len(prompts)} prompt(s) x {cfg.num_samples} samples, kv_cache={cfg.kv_cache})",
        file=sys.stderr,
    )


if __name__ == "__main__":
    run_main(main)
