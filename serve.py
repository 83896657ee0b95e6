"""Serve a model over OpenAI's API (chat and text completions, streamed or not), with a chat page;
requests in flight at the same time are decoded together, one batch per step.

    python serve.py --out_dir=out-chat-demo                       # http://127.0.0.1:8000/ : the chat page
    python serve.py --out_dir=out-shakespeare-char --port=8001    # a base model: /v1/completions
    python serve.py --init_from=gpt2 --batch_size=32              # released GPT-2 (transformers)
    python serve.py --init_from=Llama-3.2-1B-Instruct --context=4096
    OPENAI_API_KEY=secret python serve.py --out_dir=out-chat-demo --host=0.0.0.0   # on the network: a key
    python serve.py --help

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "out-chat-demo", "messages": [{"role": "user", "content": "Reverse: sule pova"}], "temperature": 0}'

Endpoints: POST /v1/chat/completions (models with a chat template), POST /v1/completions (any
model), GET /v1/models, GET /health, GET / (static/chat.html). Requests and replies have OpenAI's
shapes; a field the model cannot honour gets a 400, and every error is OpenAI's error JSON.

Reads top to bottom: errors, request shapes, the model's side (a reply's text as the engine makes
it, the Worker that owns the engine, the model's own process and serve.py's end of it), the
server the event loop holds and its replies (one JSON object, or server-sent events), the app,
main.
"""

import asyncio
import json
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Literal, Optional, Union

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from gpt import inference
from gpt import runtime
from gpt import tokenizer
from configurator import ServeConfig, UserError, parse, run_main

PAGE = Path(__file__).resolve().parent / "static" / "chat.html"
MAX_CONTEXT = 8192  # context=0 takes the model's block_size up to this, as chat.py does


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """A request the server refuses: becomes OpenAI's error JSON with this status."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = status, message, param, code, kind, headers


def error_body(message, kind="invalid_request_error", param=None, code=None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e):
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status, headers=e.headers)


def validation_message(errors):
    """One line for pydantic's first complaint: where in the body, and what is wrong."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return "the body is not valid JSON: " + first.get("ctx", {}).get("error", "a syntax error"), None
    loc = [str(part) for part in first["loc"] if part != "body"]
    param = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        return f"unknown field {param!r}: this server does not take it (OpenAI's fields only); leave it out", param
    if first["type"] == "missing":
        return f"{param} is required", param
    return f"{param or 'the body'}: {first['msg']}", param


# ---------------------------------------------------------------------------- request shapes


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None  # refused when set: the chat template has no place for it

    def text(self):
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


# fields of OpenAI's API this server cannot honour: a request that sets one gets a 400, not a reply
# that silently ignores it. The value each may have (OpenAI's default, which means "not used").
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None,), "logit_bias": (None, {}), "presence_penalty": (None, 0),
               "frequency_penalty": (None, 0), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "echo": (None, False),
               "suffix": (None, ""), "best_of": (None, 1), "audio": (None,), "modalities": (None, ["text"]),
               "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False)}


class Sampling(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)  # None (or left out): 1, as OpenAI
    top_p: Optional[float] = Field(None, gt=0, le=1)  # None: 1, no nucleus
    top_k: Optional[int] = Field(None, ge=1)  # not OpenAI's; vLLM's and llama.cpp's
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logprobs: Union[bool, int, None] = None
    top_logprobs: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None

    def check(self):
        """The stop strings; APIError for what the model cannot honour."""
        for i, m in enumerate(getattr(self, "messages", [])):
            if m.name is not None:
                raise APIError(400, f"messages.{i}.name is not supported by this server; leave it out", f"messages.{i}.name")
        for key, allowed in UNSUPPORTED.items():
            value = getattr(self, key, None)
            if value not in allowed:
                raise APIError(400, f"{key}={json.dumps(value)} is not supported by this server; leave {key} out", key)
        if self.n not in (None, 1):
            raise APIError(400, f"n={self.n}: this server makes one choice per request; send n=1 (or leave it out)", "n")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4 or not all(stops):
            raise APIError(400, "stop takes at most 4 strings, none of them empty", "stop")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; give one of them", "max_completion_tokens")
        return stops


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[Any] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None


class CompletionRequest(Sampling):
    prompt: Union[str, list[str], list[int]]
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


# ---------------------------------------------------------------------------- the model's side


class Reply:
    """One request's reply text as the engine makes it, on the engine's thread: on_token and
    on_done put ("text", piece), then ("done", finish_reason, tokens, error), in the worker's
    outbox under the request's id. Text that could be the start of a stop string, or a character
    whose bytes have not all come, is held back; at a stop string the reply ends before it."""

    def __init__(self, worker, rid, decode, stops):
        self.worker, self.rid, self.decode, self.stops = worker, rid, decode, stops
        self.ids, self.text, self.sent, self.stopped = [], "", 0, False

    def _put(self, item):
        self.worker.items.append((self.rid, item))

    def _send_to(self, end):
        if end > self.sent:
            self._put(("text", self.text[self.sent : end]))
            self.sent = end

    def on_token(self, token):
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.text[: self.sent]):
            return False  # a character still being made (BPE bytes): wait for the next token
        self.text = text
        longest = max(map(len, self.stops), default=0)
        hits = [i for i in (text.find(s, max(0, self.sent - longest)) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = text[: min(hits)], True
            self._send_to(len(self.text))
            return True
        held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._send_to(len(text) - held)
        return False

    def on_done(self, reason, tokens, error):
        if not self.stopped:
            self.text = self.decode(self.ids)
            self._send_to(len(self.text))
        self._put(("done", reason, tokens, error))
        self.worker.requests.pop(self.rid, None)


class Worker:
    """The model, the engine that decodes every request, and each reply's text as it is made. It
    lives where the model runs: in a process of its own (--engine=process), or in serve.py's own
    (--engine=thread). After each step, send(items, stats) hands the event loop that step's
    output, (request id, item) pairs, in one piece: one wake-up for all rows' tokens."""

    def __init__(self, cfg, rt, send):
        model, tok_spec = inference.load_model(cfg.init_from, cfg.out_dir, cfg.checkpoint, report=print)
        block_size = model.config.block_size
        if cfg.context > block_size:
            raise UserError(f"context={cfg.context} is longer than the model's block_size={block_size}")
        context = cfg.context or min(block_size, MAX_CONTEXT)
        self.info = {"tok_spec": tok_spec, "vocab_size": model.config.vocab_size, "context": context}
        _, decode = tokenizer.load(tok_spec)
        self.decoders = {False: decode}
        try:
            self.decoders[True] = inference.chat_template(model.config.vocab_size, tok_spec, cfg.init_from, cfg.out_dir).decode
        except UserError:
            pass  # the server's side says so to a chat request
        model.eval().to(rt.device)
        if cfg.compile:
            # the engine's packed steps change shape from step to step (the tokens in flight): sizes
            # symbolic from the start, where dynamo would compile each graph for the first shape and
            # again, symbolic, at the next (13 graphs against 9 in tests/test_serve.py's engine test)
            model.compile(dynamic=True)
        self.send, self.items, self.requests = send, [], {}
        self.engine = inference.Engine(model, rows=cfg.batch_size, waiting=cfg.max_waiting, room=context,
                                       device=rt.device, autocast=rt.autocast, after_step=self.flush, compiled=cfg.compile)

    def submit(self, rid, ids, max_tokens, sampling, chat, stop_ids, stops):
        reply = Reply(self, rid, self.decoders[chat], stops)
        request = inference.Request(ids, max_tokens, reply.on_token, reply.on_done, stop_ids=stop_ids, **sampling)
        self.requests[rid] = request
        if not self.engine.submit(request):  # closed: the server is going down
            reply.on_done("cancelled", 0, None)
            self.flush()

    def cancel(self, rid):
        request = self.requests.get(rid)
        if request is not None:
            request.cancelled = True  # its row is freed before the next step

    def flush(self):  # the engine's after_step, on its thread
        if self.items:
            items, self.items = self.items, []
            self.send(items, self.engine.stats())


def engine_process(cfg, inbox, outbox):
    """The model's process (--engine=process): a Worker, its engine on a thread, and this thread
    reading serve.py's requests and cancellations. It ends when serve.py says so or is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is serve.py's to handle: it then closes this process
    try:
        worker = Worker(cfg, runtime.setup(cfg.device, cfg.dtype), lambda items, stats: outbox.send((items, stats)))
    except UserError as e:
        outbox.send(("error", str(e)))
        return
    except Exception as e:  # noqa: BLE001 (our bug: the traceback goes to stderr, serve.py exits with it)
        traceback.print_exc()
        outbox.send(("bug", f"{type(e).__name__}: {e}"))
        return
    outbox.send(("ready", worker.info))
    worker.engine.start()
    try:
        while (message := inbox.recv())[0] != "close":
            getattr(worker, message[0])(*message[1:])  # submit or cancel
    except EOFError:
        pass  # serve.py went away without a word (killed): nobody is left to answer
    finally:
        worker.engine.close()


class EngineProcess:
    """serve.py's end of the model's process: it sends requests and cancellations down one pipe,
    and the event loop reads each step's output from the other as it comes (a reader on the
    pipe, no thread). The model and the event loop then run on two cores, each with its own
    GIL; in one process every tensor op and every socket write took the GIL from the other."""

    def __init__(self, cfg, deliver):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or device state forked
        inbox, self.requests = context.Pipe(duplex=False)
        self.outputs, outbox = context.Pipe(duplex=False)
        self.process = context.Process(target=engine_process, args=(cfg, inbox, outbox), name="serve.py model", daemon=True)
        self.process.start()
        inbox.close()
        outbox.close()
        self.deliver, self.loop, self.stopped = deliver, None, None
        try:
            kind, what = self.outputs.recv()
        except EOFError:
            self.process.join()
            raise UserError(f"the model's process ended (exit code {self.process.exitcode}) while it loaded the model; "
                            f"if it ran out of memory, try a smaller --context or --dtype=bfloat16")
        if kind != "ready":
            self.process.join()
        if kind == "error":
            raise UserError(what)
        if kind == "bug":
            raise RuntimeError(f"the model's process failed while it loaded the model ({what})")
        self.info = what

    def listen(self, loop):
        if self.loop is None:
            self.loop = loop
            loop.add_reader(self.outputs.fileno(), self._read)

    def _read(self):
        try:
            while self.outputs.poll():
                self.deliver(*self.outputs.recv())
        except (EOFError, OSError):
            self.loop.remove_reader(self.outputs.fileno())
            self._ended()
            self.deliver(None, None)  # every request still held ends with that

    def _ended(self):
        self.process.join(5)
        self.stopped = f"the model's process has stopped (exit code {self.process.exitcode}); restart serve.py"

    def check(self):
        """APIError 503 once the model's process is gone."""
        if self.stopped:
            raise APIError(503, self.stopped, code="engine_stopped", kind="server_error")

    def send(self, *message):
        """A request or a cancellation to the model's process; a request gets 503 once it is gone (a
        cancellation then has nothing left to cancel)."""
        if not self.stopped:
            try:
                return self.requests.send(message)
            except OSError:  # it died, and the reader has not seen the end of its pipe yet
                self._ended()
        if message[0] == "submit":
            self.check()

    def close(self):
        try:
            self.requests.send(("close",))
        except OSError:
            pass  # already gone
        self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


# ---------------------------------------------------------------------------- the server


class Server:
    """What the event loop holds: the tokenizer and chat template that make a request's prompt,
    each request's queue of reply items, and the model's side (a Worker, in a process of its own
    or on a thread of this one: `cfg.engine`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        source = cfg.out_dir if cfg.init_from == "resume" else cfg.init_from
        self.name = cfg.name or os.path.basename(os.path.normpath(source))
        self.pending = {}  # request id -> its asyncio.Queue of reply items, until its ("done", ...)
        self.cancelled = set()  # the ids of those of them cancelled
        self.loop, self.stats = None, {"active": 0, "steps": 0}
        if cfg.engine == "process":
            self.process = EngineProcess(cfg, self.deliver)
            self.worker, self.engine, info = None, None, self.process.info
        else:
            self.process = None
            self.worker = Worker(cfg, runtime.setup(cfg.device, cfg.dtype), self.deliver_soon)
            self.engine, info = self.worker.engine, self.worker.info  # tests reach into the engine
        tok_spec, self.vocab_size, self.context = info["tok_spec"], info["vocab_size"], info["context"]
        try:
            self.template, self.no_chat = inference.chat_template(self.vocab_size, tok_spec, cfg.init_from, cfg.out_dir), None
        except UserError as e:
            self.template, self.no_chat = None, str(e)
        self.encode, self.decode = tokenizer.load(tok_spec)
        self.eot = tokenizer.eot(tok_spec)
        self.api_key = cfg.api_key or os.environ.get("OPENAI_API_KEY", "")
        self.created = int(time.time())

    def start(self):
        if self.engine is not None:
            self.engine.start()
        return self

    def close(self):
        if self.process is not None:
            self.process.close()
        else:
            self.engine.close()

    def deliver(self, items, stats):
        """A step's output, on the event loop: each item to its request's queue. (None, None):
        the model's process is gone, and every request still held ends ("stopped": a 503)."""
        if items is None:
            items = [(rid, ("done", "stopped", 0, self.process.stopped)) for rid in self.pending]
        else:
            self.stats = stats
        for rid, item in items:
            if item[0] != "done":
                self.pending[rid].put_nowait(item)
            else:
                self.pending.pop(rid).put_nowait(item)
                self.cancelled.discard(rid)

    def deliver_soon(self, items, stats):  # a thread's Worker: called on the engine's thread
        self.loop.call_soon_threadsafe(self.deliver, items, stats)

    def health(self):
        if self.process is not None:
            self.process.check()
        active = min(self.stats["active"], len(self.pending))
        return {"active": active, "waiting": len(self.pending) - active, "rows": self.cfg.batch_size,
                "steps": self.stats["steps"]}

    def check_model(self, name):
        if name != self.name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.name!r} (GET /v1/models)",
                           "model", "model_not_found")

    def prompt_ids(self, body):
        """The token ids of a completion request's prompt (sample.py's rules for an empty one)."""
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = self.vocab_size
            if not all(0 <= i < vocab for i in prompt):
                raise APIError(400, f"prompt holds a token id outside this model's vocabulary 0..{vocab - 1}", "prompt")
            return list(prompt)
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, f"prompt is a list of {len(prompt)} strings: send one prompt per request", "prompt")
            prompt = prompt[0]
        try:
            ids = self.encode(prompt)
        except UserError as e:
            raise APIError(400, str(e), "prompt")
        if not ids and self.eot is None:
            raise APIError(400, "the prompt is empty; give it some text", "prompt")
        return ids or [self.eot]  # GPT-2 saw <|endoftext|> before every document: an empty prompt starts one

    def chat_ids(self, body):
        if self.template is None:
            raise APIError(400, f"{self.name} has no chat template, so it cannot chat: use /v1/completions, or "
                                f"fine-tune it on conversations first ({self.no_chat.split(': ', 1)[-1]})", "messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        return self.template.render(messages, add_generation_prompt=True)[0]

    def limit(self, body, n_prompt):
        """The most new tokens for this request: max_(completion_)tokens, checked against the context."""
        if n_prompt >= self.context:
            raise APIError(400, f"the prompt is {n_prompt} tokens, longer than this model's context of {self.context} "
                                f"tokens (with room for one new token); shorten it", "messages", "context_length_exceeded")
        left = self.context - n_prompt
        wanted = body.max_completion_tokens or body.max_tokens
        if wanted is not None and wanted > left:
            key = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise APIError(400, f"{key}={wanted} is more than the {left} tokens left of the context of {self.context} "
                                f"after the {n_prompt}-token prompt; ask for at most {left}", key, "context_length_exceeded")
        return wanted or left

    def start_request(self, body, ids, chat, stop_ids, stops):
        """Hand the request to the model's side: (its id, the queue its reply items come to); 429
        when every row is busy and max_waiting requests wait."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()  # uvicorn's one loop
            if self.process is not None:
                self.process.listen(self.loop)
        max_tokens = self.limit(body, len(ids))
        if len(self.pending) >= self.cfg.batch_size + self.cfg.max_waiting:
            raise APIError(429, f"the server is full ({self.cfg.batch_size} requests decoding, {self.cfg.max_waiting} "
                                f"waiting); retry in a moment", None, "server_busy", "rate_limit_error", {"Retry-After": "1"})
        sampling = {"temperature": 1.0 if body.temperature is None else body.temperature,
                    "top_p": 1.0 if body.top_p is None else body.top_p, "top_k": body.top_k, "seed": body.seed}
        rid, queue = uuid.uuid4().hex, asyncio.Queue()
        self.tell("submit", rid, ids, max_tokens, sampling, chat, stop_ids, stops)
        self.pending[rid] = queue
        return rid, queue

    def cancel(self, rid):
        """Free a request's row before the next step (a no-op once it has ended)."""
        if rid in self.pending and rid not in self.cancelled:
            self.cancelled.add(rid)
            self.tell("cancel", rid)

    def tell(self, kind, *args):
        """A request ('submit') or a cancellation ('cancel') to the model's side, wherever it runs."""
        if self.process is not None:
            self.process.send(kind, *args)
        else:
            getattr(self.worker, kind)(*args)


def usage(n_prompt, n_completion):
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


async def wait_done(http, server, rid, queue):
    """The end of a reply that is not streamed, and its text; a client that hangs up cancels it."""
    pieces = []
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await http.is_disconnected():  # its row is freed at the next step; nobody reads this answer
                server.cancel(rid)
                raise APIError(499, "the client closed the connection")
            continue
        if item[0] == "text":
            pieces.append(item[1])
        else:
            return item, "".join(pieces)


def done_error(item):
    _, reason, _, error = item
    if reason == "error":
        raise APIError(500, f"the server failed while generating ({error}); please report it", kind="server_error")
    if reason == "stopped":  # the model's process is gone
        raise APIError(503, error, code="engine_stopped", kind="server_error")
    return reason


async def respond(http, server, body, ids, stop_ids, stops, chat):
    """The reply, as one JSON object or as server-sent events."""
    rid, queue = server.start_request(body, ids, chat, stop_ids, stops)
    created = int(time.time())
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": server.name}
    if not body.stream:
        item, text = await wait_done(http, server, rid, queue)
        reason = done_error(item)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}} if chat
                  else {"index": 0, "text": text})
        return {**head, "choices": [{**choice, "logprobs": None, "finish_reason": reason}], "usage": usage(len(ids), item[2])}
    with_usage = body.stream_options is not None and body.stream_options.include_usage

    def hang_up():  # the client went away mid-stream: its row is freed at the next step, and the stream ends
        server.cancel(rid)
        queue.put_nowait(("gone",))

    return EventStream(events(server, rid, queue, head, chat, len(ids), with_usage), hang_up,
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def events(server, rid, queue, head, chat, n_prompt, with_usage):
    """OpenAI's chunks, as (text, last) pairs: the role first (chat), a chunk per piece of text
    (pieces that queued up while the client read go out together), one with finish_reason, the
    usage if asked for, then [DONE]. The role goes out with the first piece, and the end in one
    piece, so a reply of n tokens is about n + 2 writes to the socket."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if with_usage else {}

    def chunk(piece=None, reason=None, role=False):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece is not None else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": piece or ""}
        return f"data: {json.dumps({**head, 'choices': [{**choice, 'logprobs': None, 'finish_reason': reason}], **extra})}\n\n"

    # a chunk of text is the same JSON around the piece each time: serialize the rest once
    before, _, after = chunk("\0").rpartition(json.dumps("\0"))  # the piece is the last string in it

    def text(piece):
        return before + json.dumps(piece) + after

    pending = chunk(role=True) if chat else ""  # sent with the first piece of text
    try:
        while True:
            item = await queue.get()
            pieces = []
            while item is not None and item[0] == "text":  # text that came while the last chunk went out goes as one
                pieces.append(item[1])
                item = None if queue.empty() else queue.get_nowait()
            if pieces:
                yield pending + text("".join(pieces)), False
                pending = ""
            if item is None:
                continue
            if item[0] == "gone":  # the client hung up
                return
            _, reason, n_completion, error = item
            if reason in ("error", "stopped"):
                message, code = (error, "engine_stopped") if reason == "stopped" else \
                    (f"the server failed while generating ({error})", None)
                end = [f"data: {json.dumps(error_body(message, 'server_error', code=code))}\n\n"]
            else:
                end = [chunk(reason=reason)]
                if with_usage:
                    end.append(f"data: {json.dumps({**head, 'choices': [], 'usage': usage(n_prompt, n_completion)})}\n\n")
            yield "".join([pending, *end, "data: [DONE]\n\n"]), True
            return
    finally:
        server.cancel(rid)  # a no-op after the end


class EventStream(Response):
    """A stream of server-sent events: each (text, last) the iterator yields is written at once,
    the last with the end of the body. hang_up() is called when the client disconnects before
    the end (a watcher reads the connection's disconnect). Starlette's StreamingResponse does the
    same with a task group and a message per write; on a small model that was most of what a
    streamed token cost the server."""

    media_type = "text/event-stream"

    def __init__(self, chunks, hang_up, headers=None):
        self.chunks, self.hang_up, self.status_code, self.background = chunks, hang_up, 200, None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.hang_up()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for text, last in self.chunks:
                await send({"type": "http.response.body", "body": text.encode(), "more_body": not last})
        finally:
            watcher.cancel()


# ---------------------------------------------------------------------------- the app


class BodyLimit:
    """ASGI middleware: a body past `limit` bytes gets 413, whether its Content-Length says so or
    it only turns out so while it is read."""

    def __init__(self, app, limit):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            status, message = (413, f"the body is {int(length)} bytes, more than this server's limit of {self.limit}") \
                if length.isdigit() else (400, "the Content-Length header is not a number")
            return await error_response(APIError(status, message))(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"the body is more than this server's limit of {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


def make_app(server):
    """The FastAPI app of a Server."""
    app = FastAPI(title="gpt-trainer serve.py", version="1", summary="OpenAI-compatible completions from one model")
    app.add_middleware(BodyLimit, limit=server.cfg.max_body)

    @app.exception_handler(APIError)
    async def api_error(_, e):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e):
        message, param = validation_message(e.errors())
        return error_response(APIError(400, message, param))

    @app.exception_handler(HTTPException)
    async def http_error(_, e):
        return error_response(APIError(e.status_code, str(e.detail), headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def bug(_, e):
        return error_response(APIError(500, f"the server failed ({type(e).__name__}); please report it", kind="server_error"))

    async def authorized(http: Request):  # async: a plain def would run in a worker thread for every request
        if server.api_key:
            scheme, _, key = http.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), server.api_key.encode()):
                raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatRequest, http: Request):
        stops = body.check()
        server.check_model(body.model)
        ids = server.chat_ids(body)
        return await respond(http, server, body, ids, (server.template.end_id,), stops, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, http: Request):
        stops = body.check()
        server.check_model(body.model)
        ids = server.prompt_ids(body)
        stop_ids = () if server.eot is None else (server.eot,)  # sample.py's stop_at_eot
        return await respond(http, server, body, ids, stop_ids, stops, chat=False)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "gpt-trainer"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.name, "chat": server.template is not None, "context": server.context,
                **server.health()}

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(PAGE, media_type="text/html")

    return app


def listen(host, port):
    """The server's socket, listening before the model loads: a taken port fails at once, in one line,
    and a client that connects early waits instead of being refused."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets that say so, and
        # without it every streamed chunk after the first waits ~40 ms for the client's delayed ACK (Nagle)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from now on, while the model loads
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or --host")
    return sock


def main(argv=None):
    cfg = parse(ServeConfig, argv)
    sock = listen(cfg.host, cfg.port)
    server = Server(cfg)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not server.api_key:
        print(f"warning: listening on {cfg.host} with no API key: anyone who can reach this machine can use the "
              f"model; set --api_key or OPENAI_API_KEY", file=sys.stderr)
    what = "chat and completions" if server.template is not None else "completions only (no chat template)"
    print(f"serving {server.name} ({what}, context {server.context}, {cfg.batch_size} rows) on "
          f"http://{cfg.host}:{sock.getsockname()[1]}/", file=sys.stderr, flush=True)
    server.start()
    http = uvicorn.Server(uvicorn.Config(make_app(server), log_level="warning"))
    try:
        http.run(sockets=[sock])
    finally:
        server.close()
    if http.should_exit:
        # uvicorn caught Ctrl-C (or SIGTERM) and shut down; it re-raises the signal inside asyncio.run,
        # which turns it into KeyboardInterrupt only if the main task was still running: end the same
        # way whichever won that race
        raise KeyboardInterrupt
    return 0


if __name__ == "__main__":
    run_main(main)
