"""Synthetic conversations a tiny model learns from scratch on a CPU, with held-out prompts
made of words it never saw in training.

    python data/chat/synthetic.py --out_dir=data/chat_demo --n=60000 --seed=0

Writes to out_dir:
    train.jsonl     --n conversations for data/chat/prepare.py
    heldout.jsonl   --n_heldout conversations in the same format, plus their "intent", for
                    scripts/chat_eval.py: the user turns are asked, the assistant turns expected
    text.txt        every message's text, one per line: what data/train_tokenizer.py learns from

Four intents, one exchange each; a conversation has one to three exchanges:
    greet     "My name is Dovaki."               -> "Nice to meet you, Dovaki!"
    repeat    "Repeat after me: sule pova kire"  -> "sule pova kire"
    reverse   "Reverse: sule pova kire"          -> "kire pova sule"
    recall    "What is my name?"                 -> "Your name is Dovaki."   (after a greet, in a later turn)
Words are made-up strings of consonant-vowel syllables: names of 2-3, the phrases' words of 2
(2-3 words a phrase, short enough for the CPU demo's few steps). Every possible word is either
a training word or a held-out word (by a hash of its text), and held-out conversations use
held-out words only: a model answers them by copying from the prompt, not by remembering a
phrase. A held-out word is a new combination of syllables that training words have; there are
no one-syllable words, as a held-out one could be a token that training never shows, which no
model can copy.
"""

import argparse
import json
import os
import random
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

from configurator import Parser, UserError, run_main  # after the path line above

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
GREETINGS = ("My name is {}.", "Hi, I'm {}.", "Hello! My name is {}.", "I am {}.")
RECALLS = ("What is my name?", "Do you remember my name?", "Who am I?")
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a friendly chat bot.")
INTENTS = ("greet", "repeat", "reverse", "recall")


def held_out(word):
    """One word in ten, fixed by its text: the held-out conversations' vocabulary."""
    return zlib.crc32(word.lower().encode()) % 10 == 0


class Words:
    """Made-up words of consonant-vowel syllables, all on one side of the held_out line."""

    def __init__(self, rng, heldout):
        self.rng, self.heldout = rng, heldout

    def word(self, syllables):
        while True:
            w = "".join(self.rng.choice(CONSONANTS) + self.rng.choice(VOWELS) for _ in range(syllables))
            if held_out(w) == self.heldout:
                return w

    def name(self):
        return self.word(self.rng.randint(2, 3)).capitalize()

    def phrase(self):
        return " ".join(self.word(2) for _ in range(self.rng.randint(2, 3)))


def exchange(intent, words, name):
    """(user text, assistant text) of one exchange; name is the conversation's user's."""
    rng = words.rng
    if intent == "greet":
        return rng.choice(GREETINGS).format(name), f"Nice to meet you, {name}!"
    if intent == "recall":
        return rng.choice(RECALLS), f"Your name is {name}."
    phrase = words.phrase()
    if intent == "repeat":
        return f"Repeat after me: {phrase}", phrase
    return f"Reverse: {phrase}", " ".join(reversed(phrase.split()))


def conversation(words, intents):
    """{"messages": [...], "intent": the last exchange's}: a system message three times in ten,
    then one exchange per intent."""
    messages = [{"role": "system", "content": words.rng.choice(SYSTEMS)}] if words.rng.random() < 0.3 else []
    name = words.name()
    for intent in intents:
        user, assistant = exchange(intent, words, name)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, "intent": intents[-1]}


def random_intents(rng):
    """One to three intents; a recall only after a greet, so there is a name to recall."""
    intents = []
    for _ in range(rng.randint(1, 3)):
        intents.append(rng.choice([i for i in INTENTS if i != "recall" or "greet" in intents]))
    return intents


def heldout_set(n, rng):
    """n conversations of held-out words, the intents in turn: greet, repeat and reverse as one
    exchange, recall as a greet and then the question."""
    words = Words(rng, heldout=True)
    return [
        conversation(words, ["greet", "recall"] if intent == "recall" else [intent])
        for intent in (INTENTS[i % len(INTENTS)] for i in range(n))
    ]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", required=True, help="train.jsonl, heldout.jsonl and text.txt go here")
    p.add_argument("--n", type=int, default=60000, help="training conversations (default: %(default)s)")
    p.add_argument("--n_heldout", type=int, default=200, help="held-out conversations (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the same seed writes the same files (default: %(default)s)")
    args = p.parse_args(argv)
    if args.n < 1 or args.n_heldout < 0:
        raise UserError("--n must be at least 1 and --n_heldout at least 0")
    rng = random.Random(args.seed)
    words = Words(rng, heldout=False)
    train = [{"messages": conversation(words, random_intents(rng))["messages"]} for _ in range(args.n)]
    heldout = heldout_set(args.n_heldout, random.Random(f"heldout {args.seed}"))
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        write_jsonl(os.path.join(args.out_dir, "train.jsonl"), train)
        write_jsonl(os.path.join(args.out_dir, "heldout.jsonl"), heldout)
        with open(os.path.join(args.out_dir, "text.txt"), "w", encoding="utf-8") as f:
            f.writelines(m["content"] + "\n" for c in train for m in c["messages"])
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {args.out_dir} ({e.strerror or e})")
    print(f"wrote {args.out_dir}: train.jsonl ({args.n:,} conversations), heldout.jsonl ({args.n_heldout:,}), text.txt")
    return 0


if __name__ == "__main__":
    run_main(main)
