"""Character-level tiny Shakespeare: train.bin and val.bin (uint16 ids, 90/10 split) and
meta.json (the vocabulary) beside this file.

    python data/shakespeare_char/prepare.py                      # input.txt here, else download it
    python data/shakespeare_char/prepare.py --input path/to/input.txt
"""

import hashlib
import json
import os
import sys
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from configurator import (
    Parser,
    run_main,  # after the path line above
)

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
HERE = os.path.dirname(os.path.abspath(__file__))


def read_text(input_path):
    """The text from --input, else input.txt beside this file, else the download (checked)."""
    if input_path:
        if not os.path.isfile(input_path):
            sys.exit(f"error: --input {input_path} does not exist")
        with open(input_path, encoding="utf-8") as f:
            return f.read()
    local = os.path.join(HERE, "input.txt")
    if not os.path.exists(local):
        print(f"downloading {URL}")
        try:
            with urllib.request.urlopen(URL, timeout=30) as r:
                raw = r.read()
        except OSError as e:
            sys.exit(f"error: cannot download tiny Shakespeare ({e}); pass a local copy: --input PATH")
        if hashlib.sha256(raw).hexdigest() != SHA256:
            sys.exit(
                "error: the downloaded text is not tiny Shakespeare (sha256 mismatch); pass a local copy: --input PATH"
            )
        with open(local, "wb") as f:
            f.write(raw)
    with open(local, encoding="utf-8") as f:
        return f.read()


def prepare(text, out_dir):
    """Write the vocabulary and the two splits; returns (vocab_size, n_train, n_val)."""
    chars = "".join(sorted(set(text)))
    if len(chars) > 65535:
        sys.exit("error: more than 65535 distinct characters do not fit uint16 ids")
    lut = np.zeros(max(map(ord, chars)) + 1, dtype=np.uint16)
    lut[[ord(c) for c in chars]] = np.arange(len(chars))
    ids = lut[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]  # every character at once
    n_train = int(len(ids) * 0.9)
    for name, part in (("train", ids[:n_train]), ("val", ids[n_train:])):
        part.tofile(os.path.join(out_dir, f"{name}.bin"))
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({"vocab_size": len(chars), "chars": chars}, f, ensure_ascii=False)
    return len(chars), n_train, len(ids) - n_train


def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", help="a local copy of the text (default: input.txt here, else download)")
    parser.add_argument("--out_dir", default=HERE, help="where to write the files (default: beside this script)")
    args = parser.parse_args(argv)
    text = read_text(args.input)
    if len(text) < 2:
        sys.exit("error: the input text is empty")
    os.makedirs(args.out_dir, exist_ok=True)
    vocab, n_train, n_val = prepare(text, args.out_dir)
    print(
        f"{len(text):,} characters, vocabulary of {vocab}: {n_train:,} train and {n_val:,} val tokens in {args.out_dir}"
    )


if __name__ == "__main__":
    run_main(main)
