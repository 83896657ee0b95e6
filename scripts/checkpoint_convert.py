"""A sharded checkpoint (a DCP directory) as one full file, the format checkpoint_format='full' writes.

python scripts/checkpoint_convert.py out/ckpt_0000200 out/ckpt_0000200.pt
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from configurator import UserError, run_main  # after the path line above
from gpt.outdir.checkpoint import read_sharded, save

USAGE = (
    "python scripts/checkpoint_convert.py out/ckpt_<iter> out/ckpt_<iter>.pt "
    "(a sharded checkpoint directory, then the single file to write)"
)


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if args in (["--help"], ["-h"]):
        print(f"usage: {USAGE}")
        return 0
    if len(args) != 2 or not os.path.isdir(args[0]):
        raise UserError(f"usage: {USAGE}")
    state = read_sharded(args[0])
    save(state, args[1])
    print(f"wrote {args[1]} (iter {state['iter_num']}): the full format, as checkpoint_format='full' writes it")


if __name__ == "__main__":
    run_main(main)
