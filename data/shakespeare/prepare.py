"""Tiny Shakespeare as GPT-2 BPE, for finetuning GPT-2 (config/finetune_shakespeare.py).

    python data/shakespeare/prepare.py                      # input.txt here, else download it
    python data/shakespeare/prepare.py --input ../shared/data/tinyshakespeare/input.txt
    python train.py config/finetune_shakespeare.py
    python sample.py --out_dir=out-shakespeare --start="ROMEO:"

The text is cut into its speeches (the blank-line-separated blocks), kept in the play's order,
each ending in <|endoftext|>: val is the first 36,000 tokens (about nanoGPT's 10%), train the
rest (~300k). Every option of data/corpus.py works here (python data/shakespeare/prepare.py --help).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from configurator import run_main  # after the path line above
from data import corpus
from data.shakespeare_char.prepare import SHA256, URL  # the same text as the character-level set
from gpt.data import download

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    args = corpus.parse_args(
        argv, __doc__, out_dir=HERE, txt_separator="\n\n", shuffle_buffer=0, val_tokens=36_000, test_tokens=0
    )
    if args.input is None and args.dataset is None:
        args.input = [download.fetch(URL, SHA256, os.path.join(HERE, "input.txt"))]
    return corpus.run(args)


if __name__ == "__main__":
    run_main(main)
