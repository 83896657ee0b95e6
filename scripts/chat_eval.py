"""How many held-out conversations a chat model answers exactly, asked through chat.py.

    python scripts/chat_eval.py --out_dir=out-chat-demo --heldout=data/chat_demo/heldout.jsonl
    python scripts/chat_eval.py --out_dir=out-chat-demo --heldout=data/chat_demo/heldout.jsonl --limit=100 --jobs=1
    python scripts/chat_eval.py --out_dir=out-chat-demo --heldout=data/chat_demo/heldout.jsonl --gguf=out-chat-demo/model.gguf
    python scripts/chat_eval.py --out_dir=out-rl-demo --task=arithmetic --pass_k=8 --examples=200
    python scripts/chat_eval.py --out_dir=out-chat --task=gsm8k --test_file=gsm8k/test.jsonl --checkpoint=latest

Each line of --heldout is a conversation ({"messages": [...], "intent": ...}, as data/chat/synthetic.py
writes them). Its user turns are asked and its assistant turns expected, word for word, at
--temperature=0: a conversation with one user turn through `chat.py --prompt=...`, a longer one
through chat.py's REPL with the turns on stdin (one line each, so replies must be one line). A
system message goes in as --system. One chat.py process per conversation, --jobs at a time.
Prints the accuracy by intent and overall, the first few misses, and the wall time. --gguf asks
the same conversations of llama.cpp too (llama-cpp-python, the file `hf.py --format=gguf` wrote:
its chat template, create_chat_completion at temperature 0), and counts the conversations where
its replies are chat.py's.

--task scores pass@1..pass@k instead: on the first --examples held-out problems of a task with a
checker (scripts/chat_rl.py's: arithmetic, gsm8k or your jsonl), --pass_k samples each, drawn with
the seeds chat_rl.py's evaluations draw, so it prints what an RL run's eval at that checkpoint
logged. --out_dir is a chat run's out_dir or a Hugging Face chat directory.
"""

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configurator import Parser, UserError, run_main  # after the path line above
from gpt.device import runtime
from gpt.rl import rollouts, tasks
from gpt.weights import load


def turns(conversation):
    """(system message or '', the user turns, the assistant turns expected)."""
    messages = conversation["messages"]
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    return (
        system,
        [m["content"] for m in messages if m["role"] == "user"],
        [m["content"] for m in messages if m["role"] == "assistant"],
    )


def chat_args(system, users):
    """chat.py's arguments and stdin for one conversation."""
    args = ["--temperature=0"] + ([f"--system={system}"] if system else [])
    if len(users) == 1:
        return args + [f"--prompt={users[0]}"], None
    return args, "".join(u + "\n" for u in users)


def ask_all(conversations, ask, jobs=1):
    """chat.py's stdout for each conversation, `jobs` at a time. ask(args, stdin) runs chat.py."""
    with ThreadPoolExecutor(jobs) as pool:  # threads that wait for processes
        return list(pool.map(lambda conv: ask(*chat_args(*turns(conv)[:2])), conversations))


def score(conversations, outputs):
    """(right, asked) Counters by intent, and the misses [(users, expected, got)], from chat.py's
    outputs for the conversations."""
    right, asked, misses = Counter(), Counter(), []
    for conv, output in zip(conversations, outputs):
        _, users, expected = turns(conv)
        got = output.split("\n")[: len(expected)]  # one reply per line, each ended by a newline
        intent = conv.get("intent", "all")
        asked[intent] += 1
        if got == expected:
            right[intent] += 1
        else:
            misses.append((users, expected, got))
    return right, asked, misses


def subprocess_ask(chat_flags):
    def ask(args, stdin):
        result = subprocess.run(
            [sys.executable, str(REPO / "chat.py"), *chat_flags, *args], input=stdin, capture_output=True, text=True
        )
        if result.returncode != 0:
            lines = result.stderr.strip().splitlines()
            raise UserError(
                f"chat.py failed: {lines[-1].removeprefix('error: ') if lines else f'exit code {result.returncode}'}"
            )
        return result.stdout

    return ask


def llama_cpp_outputs(conversations, gguf_path):
    """llama.cpp's replies to each conversation, in chat.py's output format (one line per reply):
    each user turn after the replies llama.cpp gave before."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise UserError("--gguf runs llama.cpp through llama-cpp-python: pip install llama-cpp-python")
    llm = Llama(model_path=gguf_path, n_ctx=0, n_threads=1, verbose=False)  # n_ctx=0: the model's context
    outputs = []
    for conv in conversations:
        system, users, _ = turns(conv)
        messages, replies = [{"role": "system", "content": system}] if system else [], []
        for user in users:
            messages.append({"role": "user", "content": user})
            reply = llm.create_chat_completion(messages, temperature=0.0, repeat_penalty=1.0)["choices"][0]["message"][
                "content"
            ]
            messages.append({"role": "assistant", "content": reply})
            replies.append(reply)
        outputs.append("".join(r + "\n" for r in replies))
    return outputs


def report(right, asked, misses, seconds, show=5):
    n, ok = sum(asked.values()), sum(right.values())
    by_intent = ", ".join(f"{k} {right[k]}/{asked[k]}" for k in sorted(asked))
    print(f"accuracy: {ok}/{n} = {ok / max(n, 1):.1%} ({by_intent}) in {seconds:.1f} s")
    for users, expected, got in misses[:show]:
        print(f"  miss: {users} -> {got}, expected {expected}")


def pass_at_k(args):
    """--task: pass@1..pass@k of the model on the task's held-out problems, printed; the scores."""
    if args.task == "jsonl" and not args.test_file:
        raise UserError("--task=jsonl reads its held-out problems from a file: set --test_file")
    rt = runtime.setup(args.device, args.dtype)
    task = tasks.load(args.task, args.test_file, args.test_file, args.check, args.seed)
    model, spec = load.for_inference(args.out_dir, None, args.checkpoint)
    template = load.chat_template(model.config.vocab_size, spec, args.out_dir, None)
    model.to(rt.device).eval()
    problems = task.test[: args.examples]
    start = time.perf_counter()
    with rt.autocast():
        scores = rollouts.evaluate(
            model, template, task, problems, args.pass_k, args.max_new_tokens, args.temperature, None, args.seed, rt
        )
    text = ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
    print(f"{args.task}: {len(problems)} held-out problems: {text} ({time.perf_counter() - start:.1f} s)")
    return scores


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out_dir", required=True, help="the chat model's training run (--task: or a Hugging Face directory)"
    )
    p.add_argument("--heldout", help="conversations to ask, .jsonl")
    p.add_argument("--limit", type=int, default=0, help="ask only the first N (default: all)")
    p.add_argument("--jobs", type=int, default=2, help="chat.py processes at a time (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="chat.py's --device (default: %(default)s)")
    p.add_argument("--gguf", help="also ask llama.cpp, with this model.gguf (python hf.py --format=gguf)")
    rl = p.add_argument_group("pass@k on a task with a checker, as scripts/chat_rl.py scores it (its keys' defaults)")
    rl.add_argument("--task", choices=tasks.KINDS, help="score pass@1..k on this task")
    rl.add_argument(
        "--test_file", default="", help="jsonl; gsm8k: the held-out problems (default: openai/gsm8k's test split)"
    )
    rl.add_argument("--check", choices=tasks.CHECKS, default="exact", help="jsonl: how answers are checked")
    rl.add_argument("--examples", type=int, default=100, help="held-out problems scored (default: %(default)s)")
    rl.add_argument("--pass_k", type=int, default=8, help="samples per problem (default: %(default)s)")
    rl.add_argument("--max_new_tokens", type=int, default=64, help="the longest answer (default: %(default)s)")
    rl.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s)")
    rl.add_argument(
        "--seed", type=int, default=1337, help="the arithmetic task's and the samples' (default: %(default)s)"
    )
    rl.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="(default: %(default)s)")
    rl.add_argument("--dtype", default="auto", help="(default: %(default)s)")
    args = p.parse_args(argv)
    if args.task:
        pass_at_k(args)
        return 0
    if not args.heldout:
        raise UserError("give --heldout (conversations to ask) or --task (pass@k on a task's problems)")
    try:
        with open(args.heldout, encoding="utf-8") as f:
            conversations = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read --heldout {args.heldout} ({e})")
    conversations = conversations[: args.limit or None]
    ask = subprocess_ask([f"--out_dir={args.out_dir}", f"--device={args.device}"])
    start = time.perf_counter()
    outputs = ask_all(conversations, ask, args.jobs)
    report(*score(conversations, outputs), time.perf_counter() - start)
    if args.gguf:
        start = time.perf_counter()
        theirs = llama_cpp_outputs(conversations, args.gguf)
        print("llama.cpp ", end="")
        report(*score(conversations, theirs), time.perf_counter() - start)
        same = sum(a == b for a, b in zip(outputs, theirs))
        print(f"llama.cpp's replies are chat.py's in {same}/{len(conversations)} conversations")
    return 0


if __name__ == "__main__":
    run_main(main)
