"""OpenWebText (~9B GPT-2 tokens in ~8M documents), nanoGPT's GPT-2 pretraining data
(config/train_gpt2.py), streamed from Hugging Face into 100M-token shards.

    python data/openwebtext/prepare.py --estimate=2000             # tokens per document, then decide
    python data/openwebtext/prepare.py                             # all of it: ~17 GB of uint16 shards
    python data/openwebtext/prepare.py --tokens=1e9                # the first billion tokens
    python data/openwebtext/prepare.py --input owt/ --text_field=text   # a local copy (.jsonl/.parquet/.txt)

val and test are 10M tokens each (nanoGPT's val was 4.4M). Skylion007/openwebtext was a
loading-script dataset, which datasets 4 and later no longer run; if the Hub copy has not been
converted, point --dataset at a parquet copy (or --revision=refs/convert/parquet, the Hub's own
conversion, which may be partial for a dataset this large), or use local files.
Every option of data/corpus.py works here (python data/openwebtext/prepare.py --help).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from configurator import run_main  # after the path line above
from data import corpus

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    return corpus.main(
        argv, __doc__, dataset="Skylion007/openwebtext", out_dir=HERE, val_tokens=10_000_000, test_tokens=10_000_000
    )


if __name__ == "__main__":
    run_main(main)
