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

import torch

from configurator import SampleConfig, UserError, parse, run_main
from gpt import inference, load, runtime, tokenizer

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
    steps = inference.generate_tokens(
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
    rt = runtime.setup(cfg.device, cfg.dtype)
    model, tok_spec = load.for_inference(cfg.init_from, cfg.out_dir, cfg.checkpoint)
    model.eval().to(rt.device)
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
