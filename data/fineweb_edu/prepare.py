"""FineWeb-Edu (educational web pages, ~1.3T tokens; samples of 10B, 100B and 350B), streamed
from Hugging Face into 100M-token GPT-2 BPE shards, for config/train_gpt2_fineweb_edu.py.

    python data/fineweb_edu/prepare.py --estimate=2000                     # tokens per document, then decide
    python data/fineweb_edu/prepare.py                                     # all of sample-10BT: ~20 GB
    python data/fineweb_edu/prepare.py --name=sample-100BT --tokens=30e9   # 30B tokens of the 100B sample
    python data/fineweb_edu/prepare.py --tokenizer=path/to/tokenizer.json  # another tokenizer (uint32 if >65,536 ids)
    python data/fineweb_edu/prepare.py --input shards/ --out_dir=/tmp/fw   # local parquet files

val and test are 100M tokens each, taken first from the shuffled stream. An interrupted run
resumes after its last complete shard when the same command is run again.
Every option of data/corpus.py works here (python data/fineweb_edu/prepare.py --help).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from configurator import run_main  # after the path line above
from data import corpus

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    return corpus.main(
        argv,
        __doc__,
        dataset="HuggingFaceFW/fineweb-edu",
        name="sample-10BT",
        out_dir=HERE,
        val_tokens=100_000_000,
        test_tokens=100_000_000,
    )


if __name__ == "__main__":
    run_main(main)
