"""The RL demo's SFT data: scripts/chat_rl.py's generated arithmetic problems (gpt/rl/tasks.py) as
conversations, the worked answer ending in GSM8K's '#### N' as the assistant's turn. The
held-out problems (numbers never seen here) are scripts/chat_rl.py's test set, not written.

    python data/chat/arithmetic.py --out_dir=data/rl_demo --n=20000 --seed=0

Writes to out_dir: train.jsonl (--n conversations, for data/chat/prepare.py) and text.txt
(every message, one per line: what data/train_tokenizer.py learns from).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from configurator import Parser, UserError, run_main  # after the path line above
from gpt.rl import tasks


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", required=True, help="train.jsonl and text.txt go here")
    p.add_argument("--n", type=int, default=20000, help="conversations (default: %(default)s)")
    p.add_argument(
        "--seed", type=int, default=0, help="scripts/chat_rl.py's seed: the same problems (default: %(default)s)"
    )
    args = p.parse_args(argv)
    if args.n < 1:
        raise UserError("--n must be at least 1")
    problems = tasks.load("arithmetic", seed=args.seed, n_train=args.n, n_test=0).train
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "train.jsonl"), "w", encoding="utf-8") as f:
            for p in problems:
                messages = [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": p.solution}]
                f.write(json.dumps({"messages": messages}) + "\n")
        with open(os.path.join(args.out_dir, "text.txt"), "w", encoding="utf-8") as f:
            f.writelines(f"{p.prompt}\n{p.solution}\n" for p in problems)
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {args.out_dir} ({e.strerror or e})")
    print(f"wrote {args.out_dir}: train.jsonl ({args.n:,} conversations), text.txt")
    return 0


if __name__ == "__main__":
    run_main(main)
