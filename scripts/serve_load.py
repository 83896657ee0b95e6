"""Load on serve.py, or on any OpenAI-compatible server (llama.cpp's llama-server): aggregate
generated tokens/s and time to first token with 1, 4, 16 and 64 concurrent streaming clients, and a
check that every reply under load is the one its prompt gets alone.

    python scripts/serve_load.py --out_dir=out-chat-demo                    # starts serve.py on a free port
    python scripts/serve_load.py --out_dir=out-gpt2-124m-random --random_gpt2=124m --max_tokens=32 --repeats=1
    python scripts/serve_load.py --url=http://127.0.0.1:8000 --api_key=KEY  # a server already running
    python scripts/serve_load.py --url=http://127.0.0.1:8001,http://127.0.0.1:8002 --clients=1,16   # two, interleaved
    python scripts/serve_load.py --out_dir=out-chat-demo --engine_only      # no HTTP: gpt/inference/engine.py's Engine alone
    python scripts/serve_load.py --out_dir=out-gpt2-124m-random --random_gpt2=124m --llama_server=PATH/llama-server \\
        --baseline=../before --serve_args="--device=cpu --compile=True" --clients=1,16 --max_tokens=32   # three servers
    python scripts/serve_load.py --help

Each client is an asyncio task that streams one request after another (POST /v1/chat/completions,
stream=true, temperature 0) from a shared queue of fixed prompts of different lengths; a level of
C clients sends max(C * --rounds, --min_requests) requests. Before the levels, every prompt is
asked alone, one at a time: its solo reply and usage.completion_tokens. Under load a request's
streamed text must equal its prompt's solo reply, and its tokens are counted as that reply's
completion_tokens (a request whose text differs counts its streamed chunks, and is reported).

    tokens/s         generated tokens of all requests / wall time from the first send to the last [DONE]
    TTFT p50 / p99   time from a request's send to its first content chunk (nearest rank)

Every request goes on a connection of its own (the client never reuses one), so a server that
closes its connection after each reply, as llama-server does after a stream, is measured like one
that keeps it open. With several --url servers, the repeats interleave them (all levels on the
first, then the second, ..., then the next repeat), so a drift in the machine's speed falls on each
alike, and each server gets its own table.

--engine_only puts the same load on gpt/inference/engine.py's Engine in this process (each client submits its
next request when its last one ends; replies checked token for token against one-at-a-time runs):
what batching alone gives, without HTTP, JSON and the client.

--llama_server and --baseline start more servers beside serve.py, measured interleaved with it:
llama.cpp's llama-server on the GGUF export of --out_dir (hf.py --format=gguf, written into
out_dir/gguf-<dtype> when missing), on as many threads as this process may use cores, with
--rows slots of --context tokens; and the serve.py of another checkout (a git worktree of the
commit before a change) with --baseline_args. A last table gives each server's tokens/s and TTFT
against the last one's.

--random_gpt2=124m writes a GPT-2-124M-shaped chat checkpoint with random weights (GPT-2's BPE
and chat template) into --out_dir when it holds none (1b: Llama-3.2-1B's shape, context 2048): a
speed measure only, its replies are noise, and the content check compares them with their solo
replies all the same. --repeats runs the
levels several times and prints each figure's median: on a shared machine single runs are noisy.
The clients run on the same CPU as the server, so they take as little of it as they can: aiohttp
(its HTTP parser is C), only the lines up to a reply's first content parsed on the clock and the
rest after the level. The table gives the CPU they took (the client process's CPU time over the
level's wall time).
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configurator import UserError, run_main  # after the path line above

# The chat demo's four intents (data/chat/synthetic.py), with words of different lengths, so
# prompts and replies differ in length; a two-turn one recalls a name.
PROMPTS = [
    [{"role": "user", "content": "My name is Dovaki."}],
    [{"role": "user", "content": "Repeat after me: sule pova kire"}],
    [{"role": "user", "content": "Reverse: mana tobe lusi rako"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi, I'm Zuvakine."}],
    [{"role": "user", "content": "Repeat after me: kabu"}],
    [{"role": "user", "content": "Reverse: dimo fesa"}],
    [
        {"role": "user", "content": "Hello! My name is Romitu."},
        {"role": "assistant", "content": "Nice to meet you, Romitu!"},
        {"role": "user", "content": "What is my name?"},
    ],
    [
        {"role": "system", "content": "You are a friendly chat bot."},
        {"role": "user", "content": "Repeat after me: pova sule kire mana tobe"},
    ],
]


# ---------------------------------------------------------------------------- one request


async def stream_one(client, model, messages, max_tokens):
    """(the data lines, seconds to the first content chunk, seconds in all) of one streamed chat
    completion at temperature 0. Only the lines up to the first content are parsed while it runs;
    the rest is read as bytes and parsed after the level (text_of), off the clock."""
    body = {"model": model, "messages": messages, "stream": True, "temperature": 0}
    if max_tokens:
        body["max_tokens"] = max_tokens
    start = time.perf_counter()
    first, lines = None, []
    async with client.post("/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise UserError(
                f"the server answered {response.status} under load: "
                f"{(await response.text())[:300]} (429: raise serve.py's --max_waiting)"
            )
        async for line in response.content:  # to the body's end, so the connection is kept for the next request
            if line.startswith(b"data: {"):
                lines.append(line)
                if first is None and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - start
    total = time.perf_counter() - start
    return lines, total if first is None else first, total  # an empty reply: its end is its first token


def text_of(lines):
    """(reply text, content chunks) of a stream's data lines."""
    chunks = [json.loads(line[6:]) for line in lines]
    pieces = [piece for c in chunks if c["choices"] and (piece := c["choices"][0]["delta"].get("content"))]
    return "".join(pieces), len(pieces)


async def solo(client, model, messages, max_tokens):
    """(reply, completion tokens) of one request alone, not streamed."""
    body = {
        "model": model,
        "messages": messages,
        "temperature": 0,
        **({"max_tokens": max_tokens} if max_tokens else {}),
    }
    async with client.post("/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise UserError(f"the server answered {response.status} to a solo request: {(await response.text())[:300]}")
        reply = await response.json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]


# ---------------------------------------------------------------------------- one level


async def level(client, model, clients, n_requests, references, max_tokens):
    """C clients streaming n_requests requests from a shared queue: the level's figures."""
    queue = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i % len(PROMPTS))
    results = []

    async def worker():
        while not queue.empty():
            i = queue.get_nowait()
            results.append((i, *await stream_one(client, model, PROMPTS[i], max_tokens)))

    load_before = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    results = [(i, *text_of(lines), first, total) for i, lines, first, total in results]
    wrong = [(i, text) for i, text, *_ in results if text != references[i][0]]
    tokens = sum(references[i][1] if text == references[i][0] else chunks for i, text, chunks, *_ in results)
    ttft = sorted(r[3] for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * nearest_rank(ttft, 50),
        "ttft_p99_ms": 1000 * nearest_rank(ttft, 99),
        "wrong": len(wrong),
        "first_wrong": wrong[:1],
        "load_1min": load_before,
        "client_cpu": cpu / wall,
    }


def nearest_rank(sorted_values, p):
    return sorted_values[max(0, -(-len(sorted_values) * p // 100) - 1)]


async def prepare(client, url, args):
    """(model id, solo references) of one server, after one warm-up stream."""
    async with client.get("/v1/models") as models:
        if models.status != 200:
            raise UserError(f"GET {url}/v1/models answered {models.status}: {(await models.text())[:300]}")
        model = (await models.json())["data"][0]["id"]
    references = [await solo(client, model, messages, args.max_tokens) for messages in PROMPTS]
    for i, (reply, n) in enumerate(references):
        print(f"{url} solo {i}: {n} tokens: {reply!r}", file=sys.stderr)
    await stream_one(client, model, PROMPTS[0], args.max_tokens)  # warm-up
    return model, references


async def measure(urls, api_key, levels, args):
    """{url: [the figures of each level of each repeat]}, the servers interleaved repeat by repeat."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(600)
    clients = [
        aiohttp.ClientSession(
            url,
            headers=headers,
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=max(levels) + 4, force_close=True),
        )
        for url in urls
    ]
    try:
        prepared = [await prepare(client, url, args) for client, url in zip(clients, urls)]
        runs = {url: [] for url in urls}
        for repeat in range(args.repeats):
            for url, client, (model, references) in zip(urls, clients, prepared):
                for n_clients in levels:
                    figures = await level(
                        client,
                        model,
                        n_clients,
                        max(n_clients * args.rounds, args.min_requests),
                        references,
                        args.max_tokens,
                    )
                    print(json.dumps({"url": url, "repeat": repeat, **figures}), file=sys.stderr, flush=True)
                    runs[url].append(figures)
        return runs
    finally:
        for client in clients:
            await client.close()


# ---------------------------------------------------------------------------- the engine alone


def engine_runs(args, levels):
    """The same prompts and levels through engine.Engine in this process, with no HTTP: what
    batching alone gives. Each of C clients submits its next request when its last one ends."""
    import threading

    from gpt.inference.engine import Engine, Request
    from gpt.weights import load

    model, tok_spec = load.for_inference("resume", args.out_dir, report=lambda line: None)
    model.eval()
    template = load.chat_template(model.config.vocab_size, tok_spec, "resume", args.out_dir)
    prompts = [template.render(messages, add_generation_prompt=True)[0] for messages in PROMPTS]
    room = model.config.block_size

    def run(clients, n_requests, rows):
        engine = Engine(model, rows=rows, waiting=max(levels), room=room).start()
        todo, results, lock, done = list(range(n_requests)), [], threading.Lock(), threading.Event()

        def submit():
            with lock:
                if not todo:
                    return
                i = todo.pop() % len(prompts)
            tokens, first, sent = [], [], time.perf_counter()

            def on_token(t):
                first or first.append(time.perf_counter() - sent)
                tokens.append(t)
                return False

            def on_done(*_):
                results.append((i, tokens, first[0] if first else 0.0))
                if len(results) == n_requests:
                    done.set()
                submit()

            budget = args.max_tokens or room - len(prompts[i])
            engine.submit(Request(prompts[i], budget, on_token, on_done, temperature=0, stop_ids=(template.end_id,)))

        start = time.perf_counter()
        for _ in range(clients):
            submit()
        done.wait()
        wall = time.perf_counter() - start
        engine.close()
        return results, wall

    references = {i: tokens for i, tokens, _ in run(1, len(prompts), 1)[0]}
    runs = []
    for repeat in range(args.repeats):
        for clients in levels:
            load_before = os.getloadavg()[0]
            results, wall = run(clients, max(clients * args.rounds, args.min_requests), args.rows)
            wrong = [(i, t) for i, t, _ in results if t != references[i]]
            ttft = sorted(r[2] for r in results)
            n = sum(len(t) + 1 for _, t, _ in results)  # the end token too, as usage counts it
            figures = {
                "clients": clients,
                "requests": len(results),
                "tokens": n,
                "wall_s": wall,
                "tokens_per_s": n / wall,
                "ttft_p50_ms": 1000 * nearest_rank(ttft, 50),
                "ttft_p99_ms": 1000 * nearest_rank(ttft, 99),
                "wrong": len(wrong),
                "first_wrong": wrong[:1],
                "load_1min": load_before,
                "client_cpu": 0.0,
            }
            print(json.dumps({"repeat": repeat, **figures}), file=sys.stderr, flush=True)
            runs.append(figures)
    return runs


# ---------------------------------------------------------------------------- the server


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, what):
    """A server process on a free loopback port (cmd takes it as {port}), once /health answers 200:
    (process, url)."""
    port = free_port()
    cmd = [part.format(port=port) for part in cmd]
    print("starting: " + " ".join(cmd), file=sys.stderr)
    process = subprocess.Popen(cmd, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900  # serve.py --compile compiles its decoding step before it answers
    while time.time() < deadline:
        if process.poll() is not None:
            raise UserError(f"{what} exited with {process.returncode} before it answered /health")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise UserError(f"{what} did not answer /health within 900 s")


def llama_server_cmd(path, out_dir, dtype, rows, context):
    """llama-server on the GGUF export of out_dir's checkpoint (written first, into out_dir/gguf-<dtype>,
    when missing): as many threads as this process may use cores, `rows` slots of `context` tokens."""
    export_dir = os.path.join(out_dir, f"gguf-{dtype}")
    gguf = os.path.join(export_dir, "model.gguf")
    if not os.path.exists(gguf):
        subprocess.run(
            [
                sys.executable,
                "hf.py",
                f"--out_dir={out_dir}",
                "--format=gguf",
                f"--gguf_dtype={dtype}",
                f"--export_dir={export_dir}",
            ],
            cwd=REPO,
            check=True,
        )
    cores = str(len(os.sched_getaffinity(0)))
    return [path, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-t", cores, "-tb", cores, "--jinja"] + [
        "-np",
        str(rows),
        "-c",
        str(rows * context),
        "--no-webui",
    ]


# the shapes --random_gpt2 writes: GPT-2 124M's, and config/train_llama_1b.py's (Llama-3.2-1B's, with
# GPT-2's vocabulary and a context of 2048)
RANDOM_SHAPES = {
    "124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "1b": dict(
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        mlp="swiglu",
        mlp_hidden=8192,
        pos_encoding="rope",
        rope_theta=500000.0,
        norm="rmsnorm",
        bias=False,
        block_size=2048,
    ),
}


def write_random_gpt2(out_dir, shape):
    """A chat checkpoint of the shape with random weights (speed only), GPT-2's BPE and chat template,
    as train.py writes one."""
    import dataclasses
    import math

    import torch

    from gpt.data import tokenizer
    from gpt.data.chat_template import Template
    from model import GPT, GPTConfig

    spec = tokenizer.make_spec("gpt2")
    template = Template(spec)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**RANDOM_SHAPES[shape], vocab_size=template.vocab_size, dropout=0.0))
    os.makedirs(out_dir, exist_ok=True)
    torch.save(
        {
            "model": model.state_dict(),
            "model_args": dataclasses.asdict(model.config),
            "config": {},
            "iter_num": 0,
            "best_val_loss": math.nan,
            "tokenizer": {**spec, "vocab_size": template.vocab_size, "chat": template.meta()},
        },
        os.path.join(out_dir, "ckpt.pt"),
    )
    print(
        f"wrote {out_dir}/ckpt.pt: random weights, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters",
        file=sys.stderr,
    )


# ---------------------------------------------------------------------------- main


def report(runs, levels, client=True):
    """The median of each figure over the repeats, one row per level."""
    print(
        "| clients | requests | tokens | tokens/s | x one client | TTFT p50 ms | TTFT p99 ms | wrong | client CPU | load (1 min) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    med = lambda c, key: statistics.median(r[key] for r in runs if r["clients"] == c)
    base = med(levels[0], "tokens_per_s")
    for c in levels:
        wrong = sum(r["wrong"] for r in runs if r["clients"] == c)
        cpu = f"{100 * med(c, 'client_cpu'):.0f}%" if client else "-"
        print(
            f"| {c} | {med(c, 'requests'):.0f} | {med(c, 'tokens'):.0f} | {med(c, 'tokens_per_s'):.1f} | "
            f"{med(c, 'tokens_per_s') / base:.2f} | {med(c, 'ttft_p50_ms'):.0f} | {med(c, 'ttft_p99_ms'):.0f} | "
            f"{wrong} | {cpu} | {med(c, 'load_1min'):.2f} |"
        )


def served_runs(args, levels):
    """{name: runs}: the levels against each --url, or against the servers started here (and stopped
    after): serve.py on --out_dir with --serve_args, the --baseline checkout's serve.py, llama-server."""
    processes, urls = [], {u.rstrip("/"): u.rstrip("/") for u in args.url.split(",")} if args.url else {}
    try:
        if not urls:
            serve = [sys.executable, "{repo}/serve.py", f"--out_dir={os.path.abspath(args.out_dir)}", "--port={port}"]
            starts = [("serve.py", [part.replace("{repo}", str(REPO)) for part in serve] + args.serve_args.split())]
            if args.baseline:
                baseline = [part.replace("{repo}", args.baseline) for part in serve] + args.baseline_args.split()
                starts.append((f"serve.py of {args.baseline}", baseline))
            if args.llama_server:
                cmd = llama_server_cmd(args.llama_server, args.out_dir, args.gguf_dtype, args.rows, args.context)
                starts.append(("llama-server", cmd))
            for name, cmd in starts:
                process, url = start(cmd, name)
                processes.append(process)
                urls[url] = name
        runs = asyncio.run(measure(list(urls), args.api_key, levels, args))
        return {urls[url]: figures for url, figures in runs.items()}
    except aiohttp.ClientConnectionError as e:
        raise UserError(
            f"cannot talk to {' or '.join(urls)}: {e}; start the server there, or leave --url out to start serve.py"
        )
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)


def compare(by_server, levels):
    """Each server's median tokens/s and TTFT p50 against the last one's (llama-server, when started)."""
    names = list(by_server)
    reference = names[-1]
    med = lambda name, c, key: statistics.median(r[key] for r in by_server[name] if r["clients"] == c)
    print(f"\n| server | clients | tokens/s | x {reference}'s | TTFT p50 ms | x {reference}'s |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in levels:
        for name in names:
            tps, ttft = med(name, c, "tokens_per_s"), med(name, c, "ttft_p50_ms")
            print(
                f"| {name} | {c} | {tps:.1f} | {tps / med(reference, c, 'tokens_per_s'):.2f} | {ttft:.0f} | "
                f"{ttft / med(reference, c, 'ttft_p50_ms'):.2f} |"
            )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--url",
        help="a running server, or several (comma-separated, measured interleaved); "
        "without it serve.py is started on --out_dir",
    )
    p.add_argument("--out_dir", default="out-chat-demo", help="the checkpoint serve.py serves (default: %(default)s)")
    p.add_argument(
        "--serve_args", default="--device=cpu", help="more serve.py flags, space-separated (default: %(default)s)"
    )
    p.add_argument(
        "--random_gpt2",
        choices=list(RANDOM_SHAPES),
        help="first write a random chat checkpoint of GPT-2 124M's or Llama-3.2-1B's shape into --out_dir",
    )
    p.add_argument(
        "--baseline", help="also start the serve.py of this checkout (another git worktree: before a change)"
    )
    p.add_argument("--baseline_args", default="--device=cpu", help="--baseline's serve.py flags (default: %(default)s)")
    p.add_argument(
        "--llama_server", help="also start this llama-server binary on --out_dir's GGUF export (written if missing)"
    )
    p.add_argument(
        "--gguf_dtype", default="f32", choices=["f32", "f16"], help="--llama_server's weights (default: %(default)s)"
    )
    p.add_argument("--context", type=int, default=1024, help="--llama_server's tokens per slot (default: %(default)s)")
    p.add_argument("--api_key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--clients", default="1,4,16,64", help="concurrency levels (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=4, help="requests per client at each level (default: %(default)s)")
    p.add_argument("--min_requests", type=int, default=64, help="requests per level at least (default: %(default)s)")
    p.add_argument("--max_tokens", type=int, default=0, help="max_tokens per request; 0: the server's default")
    p.add_argument("--repeats", type=int, default=3, help="run the levels this many times, report medians")
    p.add_argument("--engine_only", action="store_true", help="no server: the same load on Engine in this process")
    p.add_argument(
        "--rows", type=int, default=16, help="--engine_only's rows, --llama_server's slots (serve.py's --batch_size)"
    )
    args = p.parse_args(argv)
    levels = [int(c) for c in args.clients.split(",")]
    if min(levels) < 1 or args.repeats < 1 or args.rounds < 1:
        raise UserError("--clients, --repeats and --rounds must be positive")
    if args.random_gpt2 and not os.path.exists(os.path.join(args.out_dir, "ckpt.pt")):
        write_random_gpt2(args.out_dir, args.random_gpt2)
    by_server = {"engine": engine_runs(args, levels)} if args.engine_only else served_runs(args, levels)
    wrong = 0
    for server, runs in by_server.items():
        if len(by_server) > 1:
            print(f"\n{server}\n")
        report(runs, levels, client=not args.engine_only)
        wrong += sum(r["wrong"] for r in runs)
        if any(r["wrong"] for r in runs):
            print(
                f"{server}: {sum(r['wrong'] for r in runs)} request(s) under load differ from their solo reply; the "
                f"first: {next(r['first_wrong'] for r in runs if r['wrong'])}",
                file=sys.stderr,
            )
    if len(by_server) > 1:
        compare(by_server, levels)
    return 1 if wrong else 0


if __name__ == "__main__":
    run_main(main)
