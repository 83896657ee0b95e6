"""Sample from a trained model.

    python sample.py --out_dir=out-shakespeare-char
    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=200
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt --temperature=0.6 --top_k=50
    python sample.py --help
"""

import os

import torch

import checkpoint
import runtime
import tokenizer
from configurator import SampleConfig, UserError, parse, run_main
from model import GPT, GPTConfig


def load_model(cfg, rt):
    """The model and tokenizer description from out_dir's best (or latest) checkpoint."""
    if not os.path.isdir(cfg.out_dir):
        raise UserError(f"out_dir={cfg.out_dir} does not exist; point --out_dir at a training run's directory")
    path = os.path.join(cfg.out_dir, "ckpt.pt")
    best = os.path.join(cfg.out_dir, "ckpt_best.pt")
    if cfg.checkpoint == "best" and os.path.exists(best):
        path = best
    state = checkpoint.load(path, map_location=rt.device)
    model = GPT(GPTConfig(**state["model_args"]))
    model.load_state_dict(checkpoint.model_state(state))
    # checkpoints from nanoGPT carry no tokenizer: look in their data directory, as it did
    tok_spec = state.get("tokenizer") or tokenizer.describe(os.path.join("data", state["config"].get("dataset", "")))
    print(f"loaded {path} (iter {state.get('iter_num', '?')}, best val loss {state.get('best_val_loss', float('nan')):.4f})")
    return model, tok_spec


def read_prompt(start):
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:") :]
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise UserError(f"cannot read the prompt file {path} ({e.strerror})")


def main(argv=None):
    cfg = parse(SampleConfig, argv)
    rt = runtime.setup(cfg.device, cfg.dtype)
    model, tok_spec = load_model(cfg, rt)
    model.eval().to(rt.device)
    if cfg.compile:
        model = torch.compile(model)
    encode, decode = tokenizer.load(tok_spec)
    ids = encode(read_prompt(cfg.start))
    if not ids:
        raise UserError("the prompt is empty; give --start some text (the default is a newline)")
    x = torch.tensor(ids, dtype=torch.long, device=rt.device)[None, ...]
    torch.manual_seed(cfg.seed)
    with rt.autocast():
        for _ in range(cfg.num_samples):
            y = model.generate(x, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k)
            print(decode(y[0].tolist()))
            print("---------------")


if __name__ == "__main__":
    run_main(main)
