"""serve.py on a loopback port against real clients (the openai package, httpx, schemathesis); the
engine alone: test_engine.py."""

import contextlib
import functools
import itertools
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from conftest import (
    TINY_LLAMA,
    concurrently,
    make_llama3_tokenizer,
    running,
    save_chat_checkpoint,
    train_tiny_run,
    watching,
)
from processes import load_script, run_script, start_python

from configurator import UserError, parse
from gpt.data import tokenizer
from gpt.device import runtime
from gpt.inference import serving
from model import GPT, GPTConfig
from serve import ServeConfig

KEY = "test-key-123"
NAME = "tiny"  # the model's name in the API of chat_server, chat_process and base_server

# ---------------------------------------------------------------------------- models and servers


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("serve_base"), block_size=64, max_iters=30, lr_decay_iters=30)


@pytest.fixture(scope="module")
def chat_server(serve_demo):
    with running(f"--out_dir={serve_demo[0]}", f"--name={NAME}", "--batch_size=16", "--max_waiting=8") as s:
        yield s


@pytest.fixture(scope="module")
def chat_process(serve_demo):
    args = [f"--name={NAME}", "--batch_size=16", "--max_waiting=8", "--engine=process"]
    with running(f"--out_dir={serve_demo[0]}", *args) as s:
        yield s


@pytest.fixture(scope="module")
def base_server(base):
    args = [f"--name={NAME}", f"--api_key={KEY}", "--batch_size=2", "--max_waiting=1", "--max_body=4096"]
    with running(f"--out_dir={base}", *args) as s:
        yield s


def client(s, key="unused"):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)


@functools.cache  # a command's reply, for every test that compares with it
def chat_py(out_dir, message, max_new_tokens, system=None, sampling=("--temperature=0",)):
    args = [f"--out_dir={out_dir}", "--device=cpu", f"--prompt={message}", f"--max_new_tokens={max_new_tokens}"]
    result = run_script("chat.py", *args, *sampling, *([f"--system={system}"] if system else []))
    assert result.returncode == 0 and result.stdout.endswith("\n"), result.stderr
    return result.stdout[:-1]


@functools.cache
def sample_py(out_dir, start, max_new_tokens):
    args = [f"--out_dir={out_dir}", "--device=cpu", f"--start={start}", f"--max_new_tokens={max_new_tokens}"]
    result = run_script("sample.py", *args, "--temperature=0", "--num_samples=1", "--stream=False")
    assert result.returncode == 0, result.stderr
    loaded, out = result.stdout.split("\n", 1)  # "loaded <checkpoint> ...", then the sample and the separator line
    separator = "\n" + load_script("sample.py").SEPARATOR + "\n"
    assert loaded.startswith("loaded ") and out.startswith(start) and out.endswith(separator), result.stdout
    return out[len(start) : -len(separator)]


def user_messages(heldout, n):
    return [c["messages"][-2]["content"] for c in heldout if len(c["messages"]) == 2][:n]


HI, LONG = [{"role": "user", "content": "Hi"}], [{"role": "user", "content": "sule " * 200}]


def chat(**fields):
    return {"model": NAME, "messages": HI, **fields}


def completion(prompt, max_tokens=None):
    return {"model": NAME, "prompt": prompt, **({"max_tokens": max_tokens} if max_tokens else {})}


def greedy_chat(message, max_tokens):
    return chat(messages=[{"role": "user", "content": message}], temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def sixteen(serve_demo, chat_server):
    """16 chat requests (budgets 4, 7, 10, ... tokens, three sampled with a seed), and their solo replies."""
    bodies = [greedy_chat(m, 4 + 3 * i) for i, m in enumerate(user_messages(serve_demo[1], 16))]
    for i in (2, 7, 11):
        bodies[i].update(temperature=0.9, top_p=0.95, seed=100 + i)
    return bodies, [solo(chat_server, b) for b in bodies]


def post(s, path, body=None, content=None, headers=None):
    r = httpx.post(s.url + path, json=body, content=content, headers=headers, timeout=60)
    return r, r.json()


def is_error(payload, status, r, *words):
    """OpenAI's error JSON, one line that says what to change."""
    assert r.status_code == status, (r.status_code, payload)
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    assert all(w in error["message"] for w in words), error["message"]
    return error


def solo(s, body, path="/v1/chat/completions", headers=None):
    assert not s.server.pending
    r, payload = post(s, path, body, headers=headers)
    assert r.status_code == 200, r.text
    choice = payload["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def together(c, bodies):
    def reply(body):
        if "messages" in body:
            return c.chat.completions.create(**body).choices[0].message.content
        return c.completions.create(**body).choices[0].text

    return concurrently([functools.partial(reply, body) for body in bodies])


# ---------------------------------------------------------------------------- the openai client


def streamed(chunks):
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


@pytest.mark.process
def test_openai_client_gets_chat_py_replies(serve_demo, chat_server, chat_process):
    out_dir, heldout = serve_demo
    template = chat_server.server.template
    cases = [(m, None, 40) for m in user_messages(heldout, 4)] + [
        ("My name is Dovaki.", "Answer briefly.", 40),
        ("Repeat after me: sule pova kire dano", None, 3),
    ]
    reasons = []
    for message, system, n in cases:
        expected = chat_py(out_dir, message, n, system)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
        for c in (client(chat_server), client(chat_process)):
            options = dict(model=NAME, messages=messages, temperature=0)
            reply = c.chat.completions.create(**options, max_tokens=n)
            assert reply.choices[0].message.content == expected, (message, expected)
            assert reply.usage.prompt_tokens == len(template.render(messages, add_generation_prompt=True)[0])
            usage = {"include_usage": True}
            chunks = list(
                c.chat.completions.create(**options, max_completion_tokens=n, stream=True, stream_options=usage)
            )
            assert streamed(chunks) == expected
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reply.choices[0].finish_reason
            assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
        reasons.append(reply.choices[0].finish_reason)
    assert reasons[-1] == "length" and reasons.count("stop") >= 3, reasons  # the trained replies end by themselves


@pytest.mark.process
def test_a_stop_string_ends_the_reply_before_its_first_match(serve_demo, chat_server, chat_process):
    greeting = chat_py(serve_demo[0], "Hi, I'm Zuvaki.", 40)
    stop, messages = greeting[6:9], [{"role": "user", "content": "Hi, I'm Zuvaki."}]
    for c, stream in itertools.product((client(chat_server), client(chat_process)), (False, True)):
        reply = c.chat.completions.create(
            model=NAME, messages=messages, temperature=0, stop=["zzz", stop], stream=stream
        )
        chunks = list(reply) if stream else [reply]
        text = streamed(chunks) if stream else reply.choices[0].message.content
        finish_reason = chunks[-1].choices[0].finish_reason
        assert text == greeting[: greeting.index(stop)] and finish_reason == "stop", (greeting, stop, text)


@pytest.mark.process
@pytest.mark.parametrize(
    "seed, message", [(7, "Hi, I'm Zuvaki."), (11, "Repeat after me: sule pova kire")], ids=["seed-7", "seed-11"]
)
def test_a_sample_with_a_seed_is_chat_pys_with_that_seed(serve_demo, chat_server, chat_process, seed, message):
    expected = chat_py(serve_demo[0], message, 30, sampling=("--temperature=1.5", "--top_p=0.95", f"--seed={seed}"))
    for c in (client(chat_server), client(chat_process)):
        messages = [{"role": "user", "content": message}]
        reply = c.chat.completions.create(
            model=NAME, messages=messages, temperature=1.5, top_p=0.95, seed=seed, max_tokens=30
        )
        assert reply.choices[0].message.content == expected


CONTINUATIONS = {"words": ("The king", 30), "lines": ("What is love?\nNow", 45), "newline": ("\n", 20)}


@pytest.mark.slow
@pytest.mark.parametrize("prompt, n", CONTINUATIONS.values(), ids=CONTINUATIONS)
def test_openai_client_gets_sample_py_continuation(base, base_server, prompt, n):
    c, expected = client(base_server, KEY), sample_py(base, prompt, n)
    reply = c.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=n)
    assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == n
    streamed = c.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=n, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == expected


# ---------------------------------------------------------------------------- compiled


@pytest.mark.slow
def test_a_compile_failure_at_start_up_serves_eagerly_and_says_so(base, base_server, monkeypatch, capsys):
    """As inductor does without a C++ compiler."""

    def broken(graph, example_inputs, **options):
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=broken))
    body, auth = {**completion("The king", 20), "temperature": 0}, {"Authorization": f"Bearer {KEY}"}
    expected = solo(base_server, body, "/v1/completions", auth)
    capsys.readouterr()
    steps = []
    with running(f"--out_dir={base}", f"--name={NAME}", "--compile=True") as s:
        assert s.engine.buckets is None
        s.engine.on_step = steps.append
        assert solo(s, body, "/v1/completions") == expected
    # the eager step: its own rows, over just the keys they need (compiled: a bucket, 64 keys)
    decoding = [step for step in steps if not step.packed]
    assert len(decoding) == 19 and all(
        step.rows == len(step.decoding) + len(step.joining) and step.keys == max(step.positions + step.starts) + 1
        for step in decoding
    )
    warning = "warning: torch.compile of the decoding step failed (RuntimeError: no working C++ compiler found)"
    told = [line for line in capsys.readouterr().err.splitlines() if "compile" in line]
    assert told == [f"{warning}; serving without it"]


COMPILED_STEPS = {  # id: (the device, torch.compile's options, (fused_attention, key_grain))
    "cuda": ("cuda", {"dynamic": False, "mode": "reduce-overhead"}, (False, None)),
    "cpu": ("cpu", {"dynamic": False, "options": {"cpp_wrapper": True}}, (True, 16)),
}


@pytest.mark.slow
@pytest.mark.parametrize("device, expected, attention", COMPILED_STEPS.values(), ids=COMPILED_STEPS)
def test_on_a_gpu_the_decoding_step_replays_cuda_graphs(base, monkeypatch, device, expected, attention):
    """A CUDA runtime with the weights left on the CPU; recorded at torch.compile."""
    calls, compile = [], torch.compile

    def recorded(fn, **options):
        calls.append(options)
        return compile(fn, dynamic=False, backend="eager")  # dynamo alone: what it is handed is the point

    monkeypatch.setattr(torch, "compile", recorded)
    cfg = parse(ServeConfig, [f"--out_dir={base}", "--compile=True", "--batch_size=2"])
    worker = serving.Worker(cfg, runtime.Runtime("cpu", device, torch.float32), lambda items, stats: None)
    assert calls[-1] == expected and worker.engine.buckets == [1, 2]
    assert (worker.engine.fused_attention, worker.engine.key_grain) == attention
    torch.compiler.reset()


# ---------------------------------------------------------------------------- batching


def held_requests(engine, n):
    with engine.lock:
        return engine.lock.wait_for(lambda: engine.held >= n, timeout=30)


@contextlib.contextmanager
def held(engine, n, opened=None):
    """No prompt taken in until the engine holds n requests (and opened is set): they join together."""
    rows, released = [], threading.Event()

    def gate(step):
        if step.joining and not released.is_set():
            if held_requests(engine, n) and opened is not None:
                opened.wait(30)
            released.set()  # once open, it stays open
        rows.append(len(step.decoding) + len(step.joining))

    with watching(engine, gate):
        yield rows


class Watch:
    """What the server's event loop got from the model's side and told it, as it comes."""

    def __init__(self):
        self.active, self.ends, self.submits, self.cancels = [], [], [], []
        self.changed = threading.Condition()

    def wait(self, until):
        with self.changed:
            return self.changed.wait_for(until, timeout=30)


@contextlib.contextmanager
def watched(server):
    deliver, tell, seen = server.deliver, server.tell, Watch()

    def watch_deliver(items, stats):
        deliver(items, stats)
        with seen.changed:
            seen.active.append(stats and stats["active"])
            seen.ends.extend(item[1:3] for _, item in items or () if item[0] == "done")
            seen.changed.notify_all()

    def watch_tell(kind, *args):
        told = tell(kind, *args)
        with seen.changed:
            (seen.submits if kind == "submit" else seen.cancels).append(args[0])
            seen.changed.notify_all()
        return told

    server.deliver, server.tell = watch_deliver, watch_tell
    if server.process is not None:
        server.process.deliver = watch_deliver
    try:
        yield seen
    finally:
        server.deliver, server.tell = deliver, tell
        if server.process is not None:
            server.process.deliver = deliver


@pytest.mark.slow
def test_sixteen_concurrent_clients_get_their_solo_replies(chat_server, sixteen):
    bodies, alone = sixteen
    with held(chat_server.engine, 16) as rows:
        replies = together(client(chat_server), bodies)
    assert replies == alone
    assert max(rows) == 16 and rows[-1] < 16  # one batch of all sixteen, which shrank as replies ended


@pytest.mark.slow
def test_a_request_joining_mid_generation_gets_its_solo_reply(serve_demo, chat_server):
    long = {**completion("Hi, I'm Zuvaki.", 80), "temperature": 0}  # no stop at <|end|>: a long reply
    late = greedy_chat(user_messages(serve_demo[1], 1)[0], 30)
    alone = [solo(chat_server, long, "/v1/completions"), solo(chat_server, late)]
    engine, joins, eighth = chat_server.engine, [], threading.Event()

    def pause(step):
        if step.joining:  # who joins, and who is decoding then (with how many tokens, finished or not)
            joins.append((step.joining, [(r, r.generated, r.finished) for r in step.decoding]))
        if len(joins) == 1 and step.decoding and step.decoding[0].generated >= 8:
            # after the long one's 8th token, no step until the late one is queued
            eighth.set()
            held_requests(engine, 2)

    with watching(engine, pause):
        c = client(chat_server)
        stream = c.completions.create(**long, stream=True)
        assert eighth.wait(30)
        late_reply = c.chat.completions.create(**late).choices[0].message.content
        long_reply = "".join(ch.choices[0].text for ch in stream)
    assert [long_reply, late_reply] == alone
    (long_request,), decoding = joins[0]
    (late_request,), decoding_then = joins[1]
    assert decoding == [] and late_request is not long_request
    # it joined a running batch: the long one, 8 tokens in or more and not finished
    ((request, generated, finished),) = decoding_then
    assert request is long_request and generated >= 8 and finished is None


@pytest.mark.slow
def test_llama3_chat_decoded_together_gets_chat_py_replies(tmp_path):
    """RoPE at each row's own positions, grouped-query attention, Llama 3's chat format."""
    spec = tokenizer.make_spec(str(make_llama3_tokenizer(tmp_path / "tokenizer.json")))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(TINY_LLAMA, block_size=128, vocab_size=spec["vocab_size"])))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    out_dir = save_chat_checkpoint(tmp_path / "out", model, spec)
    messages = ["Hi", "What is the capital of France?", "Reverse: one two three four five six", "東京 🙂"]
    expected = [chat_py(out_dir, m, 12) for m in messages]
    with running(f"--out_dir={out_dir}", f"--name={NAME}", "--batch_size=4") as s:
        assert s.server.template.format == "llama3"
        with held(s.engine, 4) as rows:
            replies = together(client(s), [greedy_chat(m, 12) for m in messages])
    assert replies == expected and max(rows) == 4


# ---------------------------------------------------------------------------- the model in its own process


@pytest.mark.process
def test_the_model_in_its_own_process_decodes_together_and_frees_rows(chat_process, sixteen):
    s, name = chat_process, chat_process.server.name
    assert s.engine is None and s.server.process.process.is_alive()
    (bodies, alone), c = sixteen, client(s)
    steps_before = httpx.get(s.url + "/health").json()["steps"]
    with watched(s.server) as seen:
        replies = together(c, bodies)
    assert replies == alone
    tokens, steps = sum(n for _, n in seen.ends), httpx.get(s.url + "/health").json()["steps"] - steps_before
    assert len(seen.ends) == 16 and steps < tokens and max(seen.active) >= 2, (seen.active, seen.ends)
    child = s.server.process.process.pid
    body = {"model": name, "prompt": "Hi, I'm Zuvaki.", "max_tokens": 100, "temperature": 0, "stream": True}
    with watched(s.server) as seen:
        os.kill(child, signal.SIGSTOP)  # no step runs until the hang-up has been sent
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
            assert seen.wait(lambda: seen.cancels)
        finally:
            os.kill(child, signal.SIGCONT)
        assert seen.wait(lambda: seen.ends)
    ((reason, tokens),) = seen.ends
    assert len(seen.cancels) == 1 and reason == "cancelled" and tokens < 50, (seen.cancels, seen.ends)
    assert httpx.get(s.url + "/health").json()["active"] == 0
    assert solo(s, bodies[0]) == alone[0]


@pytest.mark.process
def test_a_model_process_that_dies_fails_its_requests_and_says_so(serve_demo, chat_process):
    """chat_process's last test: it kills that server's model process (a second one would cost its start)."""
    s = chat_process
    child = s.server.process.process.pid
    body = {"model": s.server.name, "prompt": "The", "max_tokens": 20, "temperature": 0}
    assert post(s, "/v1/completions", body)[0].status_code == 200
    os.kill(child, signal.SIGSTOP)
    results = []
    with watched(s.server) as seen:
        thread = threading.Thread(target=lambda: results.append(post(s, "/v1/completions", body)))
        thread.start()
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            assert seen.wait(lambda: len(seen.submits) == 2)
            os.kill(child, signal.SIGKILL)
            events = [line for line in r.iter_lines() if line]
        thread.join(30)
    is_error(results[0][1], 503, results[0][0], "the model's process has stopped (exit code -9); restart serve.py")
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "engine_stopped"
    for r, payload in [post(s, "/v1/completions", body), (lambda r: (r, r.json()))(httpx.get(s.url + "/health"))]:
        is_error(payload, 503, r, "the model's process has stopped (exit code -9); restart serve.py")
    missing = run_script("serve.py", f"--out_dir={serve_demo[0]}/nothing", "--port=0")
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1 and missing.stderr.startswith("error: ")


# ---------------------------------------------------------------------------- errors


CHAT_ERRORS = {  # id: (the body, a dict or raw JSON; the status, words the message holds, the param it names)
    "malformed-json": (b'{"model": "x", "messages": [', 400, ["not valid JSON"], None),
    "missing-field": ({"model": NAME}, 400, ["messages is required"], "messages"),
    "mistyped-field": (chat(temperature="hot"), 400, ["temperature"], "temperature"),
    "unknown-role": (chat(messages=[{"role": "robot", "content": "Hi"}]), 400, ["messages.0.role"], "messages.0.role"),
    "prompt-past-context": (chat(messages=LONG), 400, ["context of 128 tokens", "shorten it"], "messages"),
    "max-tokens-past-context": (
        chat(max_tokens=500),
        400,
        ["max_tokens=500", "left of the context of 128"],
        "max_tokens",
    ),
    "unknown-model": (chat(model="gpt-4o"), 404, ["'gpt-4o' does not exist", NAME], "model"),
    "n": (chat(n=2), 400, ["n=2"], "n"),
    "tools": (chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, ["tools"], "tools"),
    "logprobs": (chat(logprobs=True), 400, ["logprobs"], "logprobs"),
    "response-format": (chat(response_format={"type": "json_object"}), 400, ["response_format"], "response_format"),
    "unknown-field": (chat(frobnicate=1), 400, ["unknown field 'frobnicate'"], "frobnicate"),
    "five-stops": (chat(stop=["a", "b", "c", "d", "e"]), 400, ["at most 4"], "stop"),
    "message-name": (chat(messages=[{**HI[0], "name": "bo"}]), 400, ["name"], "messages.0.name"),
    "store": (chat(store=True), 400, ["store"], "store"),
}


@pytest.mark.slow
@pytest.mark.parametrize("body, status, words, param", CHAT_ERRORS.values(), ids=CHAT_ERRORS)
def test_errors_chat(chat_server, body, status, words, param):
    raw = isinstance(body, bytes)
    headers = {"Content-Type": "application/json"} if raw else None
    r, payload = post(chat_server, "/v1/chat/completions", *((None, body) if raw else (body, None)), headers)
    assert is_error(payload, status, r, *words)["param"] == param, (body, payload)
    if body == chat(messages=LONG):  # the message says how long the prompt is
        assert str(len(chat_server.server.template.render(LONG, True)[0])) in payload["error"]["message"]


@pytest.mark.slow
def test_null_fields_take_openais_defaults(chat_server):
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None}
    r, payload = post(chat_server, "/v1/chat/completions", chat(**nulls, max_tokens=3))
    assert r.status_code == 200 and payload["usage"]["completion_tokens"] <= 3


CHUNKS = (b'{"model": "tiny", "prompt": "', *[b"x" * 1000] * 5, b'"}')  # 5 KB, sent with no Content-Length
BASE_ERRORS = {  # id: (the body (a tuple: sent in chunks), the API key sent, the status, words the message holds)
    "chat-without-a-template": (chat(), KEY, 400, ["no chat template", "/v1/completions", "fine-tune"]),
    "no-key": (completion("Hi"), None, 401, ["Authorization: Bearer"]),
    "wrong-key": (completion("Hi"), "nope", 401, ["API key"]),
    "content-length-past-the-limit": (completion("x" * 5000), KEY, 413, ["limit of 4096"]),
    "chunked-past-the-limit": (CHUNKS, KEY, 413, ["limit of 4096"]),
    "prompt-past-context": (completion("The king" * 9), KEY, 400, ["72 tokens", "context of 64"]),
    "characters-never-seen": (completion("The king 東京"), KEY, 400, ["characters this model never saw"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("body, key, status, words", BASE_ERRORS.values(), ids=BASE_ERRORS)
def test_errors_base(base_server, body, key, status, words):
    s, path = base_server, "/v1/chat/completions" if "messages" in body else "/v1/completions"
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"} if key else {}
    r, payload = post(s, path, *((None, iter(body)) if isinstance(body, tuple) else (body, None)), headers)
    error = is_error(payload, status, r, *words)
    assert key or error["code"] == "invalid_api_key", error
    assert httpx.get(s.url + "/health").status_code == 200 and httpx.get(s.url + "/v1/models").status_code == 401


def said(content):
    """A chat request's messages, raw JSON: the user's content, raw JSON too."""
    return b'"messages": [{"role": "user", "content": %s}]' % content


NOT_UNICODE = {  # id: (a chat request's fields or a completion's, raw JSON; the param the 400 names, words it holds)
    "chat-content": (said(b'"Hi \\ud800"'), "messages.0.content", ["not valid Unicode", "surrogate"]),
    "chat-content-part-in-utf8": (
        said(b'[{"type": "text", "text": "\xed\xa0\x80"}]'),
        "messages.0.content.0.text",
        ["not valid Unicode"],
    ),
    "chat-stop": (said(b'"Hi"') + b', "stop": ["a", "\\udc00"]', "stop.1", ["not valid Unicode"]),
    "chat-field-name": (said(b'"Hi"') + b', "\\ud800": 1', None, ["the body holds text that is not valid Unicode"]),
    "chat-not-utf8": (said(b'"Hi \xff"'), None, ["the body is not valid UTF-8"]),
    "completion-prompt": (b'"prompt": "The \\udfff king"', "prompt", ["not valid Unicode"]),
    "completion-prompt-list": (b'"prompt": ["The", "\\ud800"]', "prompt.1", ["not valid Unicode"]),
    "completion-stop": (b'"prompt": "The", "stop": "\\ud800"', "stop", ["not valid Unicode"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("fields, param, words", NOT_UNICODE.values(), ids=NOT_UNICODE)
def test_text_that_is_not_unicode_gets_400(request, fields, param, words):
    auth, chatting = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, b'"messages"' in fields
    s = request.getfixturevalue("chat_server" if chatting else "base_server")
    path, after = (
        ("/v1/chat/completions", chat(max_tokens=3)) if chatting else ("/v1/completions", completion("The", 3))
    )
    r, payload = post(s, path, content=b'{"model": "tiny", %s}' % fields, headers=auth)
    assert is_error(payload, 400, r, *words)["param"] == param, (fields, payload)
    assert solo(s, after, path, auth)


ENDPOINTS = {  # id: (method, path, body)
    "chat-completions": ("POST", "/v1/chat/completions", chat(max_tokens=3)),
    "completions": ("POST", "/v1/completions", completion("Hi", 3)),
    "models": ("GET", "/v1/models", None),
    "page": ("GET", "/", None),
}


@pytest.mark.slow
@pytest.mark.parametrize("method, path, body", ENDPOINTS.values(), ids=ENDPOINTS)
def test_a_host_header_naming_another_host_gets_421(chat_server, method, path, body):
    """DNS rebinding."""
    s = chat_server
    port = s.url.rsplit(":", 1)[1]
    r = httpx.request(method, s.url + path, json=body, headers={"Host": f"attacker.example:{port}"}, timeout=30)
    error = is_error(
        r.json(), 421, r, f"Host 'attacker.example:{port}'", "DNS rebinding", "--allowed_hosts=attacker.example"
    )
    assert error["code"] == "host_not_allowed" and error["type"] == "invalid_request_error"
    r = httpx.request(method, s.url + path, json=body, headers={"Host": f"10.0.0.5:{port}"}, timeout=30)
    assert r.status_code == 421, r.text  # on loopback, not even another IP address
    for host in ("localhost", "127.0.0.1", "[::1]", "127.3.2.1"):
        headers = {"Host": f"{host}:{port}", "Origin": "http://attacker.example"}
        r = httpx.request(method, s.url + path, json=body, headers=headers, timeout=30)
        cors = [h for h in r.headers if h.startswith("access-control-")]
        assert r.status_code == 200 and not cors, (host, path, r.text)


@pytest.fixture(scope="module")
def open_server(base):
    with running(f"--out_dir={base}", "--host=0.0.0.0", "--allowed_hosts=serve.example, Box.LAN") as s:
        yield s


HOSTS = ["serve.example", "box.lan.", "BOX.lan", "192.168.1.7", "localhost"]
OTHER_HOSTS = ["attacker.example", "lan", "serve.example.attacker.example"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "host, status", [(h, 200) for h in HOSTS] + [(h, 421) for h in OTHER_HOSTS], ids=HOSTS + OTHER_HOSTS
)
def test_on_every_interface_ip_addresses_and_allowed_hosts_are_answered(open_server, host, status):
    s = open_server
    port, body = s.url.rsplit(":", 1)[1], {"model": s.server.name, "prompt": "The", "max_tokens": 3}
    r = httpx.post(s.url + "/v1/completions", json=body, headers={"Host": f"{host}:{port}"}, timeout=30)
    assert r.status_code == status, (host, r.text)


def test_allowed_hosts_that_is_not_a_host_name_is_one_line():
    with pytest.raises(UserError, match="allowed_hosts: 'http://box.lan' is not a host name"):
        parse(ServeConfig, ["--allowed_hosts=box.lan,http://box.lan"])


@pytest.mark.slow
def test_connections_send_without_nagle(base_server):
    """Without TCP_NODELAY each streamed chunk after the first waits for the client's delayed ACK (~40 ms)."""
    s = base_server
    with httpx.Client(base_url=s.url) as http:  # keeps its connection open after the response
        assert http.get("/health").status_code == 200
        sockets = [c.transport.get_extra_info("socket") for c in list(s.web.server_state.connections)]
        assert sockets and all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for sock in sockets)


@pytest.mark.slow
def test_a_full_server_answers_429_at_once(base, base_server):
    s, c = base_server, client(base_server, KEY)
    expected = [sample_py(base, p, n) for p, n in CONTINUATIONS.values()]
    bodies = [{**completion(p, n), "temperature": 0} for p, n in CONTINUATIONS.values()]
    refused, results = threading.Event(), [None]
    with held(s.engine, 3, opened=refused):
        thread = threading.Thread(target=lambda: results.__setitem__(0, together(c, bodies)))
        thread.start()
        assert held_requests(s.engine, 3)
        t0 = time.monotonic()
        r, payload = post(s, "/v1/completions", completion("The", 2), headers={"Authorization": f"Bearer {KEY}"})
        waited = time.monotonic() - t0
        refused.set()
        thread.join(60)
    assert is_error(payload, 429, r, "full")["code"] == "server_busy" and r.headers["Retry-After"] == "1"
    assert waited < 5  # answered while the others were still held, not after them
    assert results[0] == expected


@pytest.mark.slow
def test_a_client_that_hangs_up_frees_its_row_at_once(serve_demo, chat_server):
    out_dir, _ = serve_demo
    s, engine = chat_server, chat_server.engine
    body = {"model": s.server.name, "prompt": "Hi, I'm Zuvaki.", "max_tokens": 100, "temperature": 0, "stream": True}
    with watched(s.server) as seen:

        def pause(step):  # after 20 tokens, no step until the hang-up is told: the reply cannot finish meanwhile
            if step.decoding and step.decoding[0].generated == 20:
                seen.wait(lambda: seen.cancels)

        with watching(engine, pause):
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                # three events and their blank lines
                events = [next(lines) for _ in range(6)][::2]
                assert all(event.startswith("data: ") for event in events) and engine.stats()["active"] == 1
            assert seen.wait(lambda: seen.ends)
    assert httpx.get(s.url + "/health").json()["active"] == 0
    # freed at the step after the hang-up at the latest
    ((reason, tokens),) = seen.ends
    assert reason == "cancelled" and tokens <= 21 and len(seen.cancels) == 1, seen.ends
    message = user_messages(serve_demo[1], 1)[0]
    assert solo(s, greedy_chat(message, 40)) == chat_py(out_dir, message, 40)


@pytest.mark.process
def test_the_command_warns_when_it_listens_beyond_loopback_with_no_key(base):
    assert parse(ServeConfig, []).host == "127.0.0.1"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = start_python(
        ["serve.py", f"--out_dir={base}", "--device=cpu", "--host=0.0.0.0", f"--port={port}"],
        env={"OPENAI_API_KEY": ""},  # '': no key
    )
    try:
        lines = [proc.stderr.readline() for _ in range(2)]  # as serve.py writes them
        assert lines[0].startswith("warning: listening on 0.0.0.0 with no API key: anyone who can reach this machine")
        assert lines[1].startswith("serving out (completions only") and f":{port}/" in lines[1]
        body = {"model": "out", "prompt": "The", "max_tokens": 3}  # out_dir's name, with no --name
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        taken = run_script("serve.py", f"--out_dir={base}", f"--port={port}", "--host=0.0.0.0")
        assert taken.returncode == 2 and taken.stderr.startswith(f"error: cannot listen on 0.0.0.0:{port}")
        assert len(taken.stderr.splitlines()) == 1
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down, then Ctrl-C ends the command as any other here
        rest = proc.communicate(timeout=30)[1]
    assert proc.returncode == 130 and rest == "interrupted\n"


# ---------------------------------------------------------------------------- fuzzing


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(serve_demo, chat_server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    s = chat_server
    schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
    statuses = []
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

        @given(case=schema.as_strategy(generation_mode=mode))
        @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(base_url=s.url, timeout=60)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.path, case.body, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text

        fuzz()
    assert 200 in statuses and 400 in statuses and s.engine.held == 0
    message = user_messages(serve_demo[1], 1)[0]
    assert solo(s, greedy_chat(message, 40)) == chat_py(serve_demo[0], message, 40)
