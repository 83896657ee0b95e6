"""Export a training run's model: a Hugging Face directory (GPT2LMHeadModel or LlamaForCausalLM, or
for the speedrun recipe's architecture this trainer's own model class, loaded with
trust_remote_code=True; with its tokenizer's files) or one GGUF file for llama.cpp, ollama and LM Studio.

    python hf.py --out_dir=out-shakespeare              # its best checkpoint -> out-shakespeare/hf
    python hf.py --out_dir=out-shakespeare --checkpoint=latest --export_dir=/tmp/my-gpt2
    python hf.py --out_dir=out-shakespeare --format=gguf --gguf_dtype=q8_0   # out-shakespeare/model.gguf
    python hf.py --help

The conversion is library code: gpt/weights/huggingface.py (both ways: released GPT-2 weights and
Hugging Face directories come in through gpt/weights/load.py) and gpt/weights/gguf_export.py. See docs/weights.md
and docs/gguf.md.
"""

import os
from dataclasses import dataclass
from typing import Literal

from configurator import UserError, parse, require_choices, run_main
from gpt.weights import gguf_export, huggingface, load


@dataclass
class ExportConfig:
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    out_dir: str = "out"  # the training run whose checkpoint is exported
    checkpoint: Literal["best", "latest"] = "best"  # 'best' (ckpt_best.pt or ckpt_best/ when present) or 'latest' (ckpt.pt or the newest ckpt_<iter>/)
    export_dir: str = ""  # where the Hugging Face directory is written ('': out_dir/hf), or model.gguf ('': out_dir)
    format: Literal["hf", "gguf"] = "hf"  # 'hf' (a Hugging Face directory) or 'gguf' (one model.gguf for llama.cpp and ollama)
    gguf_dtype: Literal["f32", "f16", "q8_0"] = "f32"  # format=gguf: the weights' type, 'f32', 'f16' or 'q8_0'
    # fmt: on

    def __post_init__(self):
        require_choices(self)


def export_gguf(cfg):
    """--format=gguf: model.gguf in export_dir (default out_dir)."""
    export_dir = cfg.export_dir or cfg.out_dir
    model, tok_spec = load.for_inference("resume", cfg.out_dir, cfg.checkpoint)
    arch = gguf_export.architecture(model.config)
    try:
        os.makedirs(export_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create export_dir={export_dir} ({e.strerror or e}); choose another --export_dir")
    path = os.path.join(export_dir, "model.gguf")
    gguf_export.write(model, tok_spec, path, arch, cfg.gguf_dtype, name=os.path.basename(os.path.abspath(cfg.out_dir)))
    if arch == "gpt2" and model.config.mlp == "gelu":
        print(
            "note: llama.cpp's gpt2 computes GELU by its tanh approximation (through a float16 table), this model "
            "by the exact GELU (mlp='gelu'): the logits differ slightly (about 1e-5 of their range in tests/test_gguf.py)"
        )
    warning = gguf_export.amx_warning(cfg.gguf_dtype)
    if warning:
        print(warning)
    run = f"llama-cli -m {path} --jinja" if "chat" in tok_spec else f"llama-completion -m {path} -no-cnv -p TEXT"
    print(f"wrote {path} ({arch}, {cfg.gguf_dtype}, {os.path.getsize(path) / 1e6:.1f} MB): {run}")


def main(argv=None):
    cfg = parse(ExportConfig, argv)
    if cfg.format == "gguf":
        export_gguf(cfg)
        return
    export_dir = cfg.export_dir or os.path.join(cfg.out_dir, "hf")
    model, tok_spec = load.for_inference("resume", cfg.out_dir, cfg.checkpoint)
    arch = huggingface.export(model, tok_spec, export_dir)
    if arch == "gpt_trainer":  # the model class is the directory's own modeling_gpt_trainer.py
        loads = f"AutoModelForCausalLM.from_pretrained({export_dir!r}, trust_remote_code=True)"
    else:
        loads = f"{'GPT2LMHeadModel' if arch == 'gpt2' else 'LlamaForCausalLM'}.from_pretrained({export_dir!r})"
    print(f"wrote {export_dir} ({arch}): {loads} loads it")


if __name__ == "__main__":
    run_main(main)
