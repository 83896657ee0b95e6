"""OpenAI's API over a serving.Server: the request shapes (a field the model cannot honour gets a
400), a request's prompt ids, token limit and sampling settings, OpenAI's error JSON for every
error, replies as one JSON object or as server-sent events, and the FastAPI app with its
middleware (a limit on the body, a check of the Host header). serve.py listens and runs it under
uvicorn.

    from gpt.inference import api, serving
    app = api.make_app(serving.Server(cfg).start())

Reads top to bottom: errors, request shapes, what a request asks of the model, replies, the app.
"""

import asyncio
import ipaddress
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Literal, Optional, Union

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

from configurator import UserError

PAGE = Path(__file__).resolve().parents[2] / "static" / "chat.html"


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """A request the server refuses: OpenAI's error JSON with this HTTP status."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers


def error_body(message, kind="invalid_request_error", param=None, code=None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e):
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status, headers=e.headers)


def not_unicode(value, path=""):
    """The dotted path to the first string in a JSON value that is not valid Unicode (a key's: the
    path to its object), or None. JSON's \\u escapes can spell half of a UTF-16 surrogate pair
    alone, and Python's json reads that into a str that neither UTF-8 nor a tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and not_unicode(key) is not None:
            return path
        found = not_unicode(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


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
UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "store": (None, False),
}


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

    @model_validator(mode="before")
    @classmethod
    def unicode_only(cls, body):
        """A 400 that says so for text that is not Unicode, before anything reads it or echoes it
        in an error (pydantic lets an APIError through to the app's handler)."""
        where = not_unicode(body)
        if where is not None:
            raise APIError(
                400,
                f"{where or 'the body'} holds text that is not valid Unicode (half of a UTF-16 "
                f"surrogate pair, \\ud800 to \\udfff, alone); send valid UTF-8 text",
                where or None,
            )
        return body

    def check(self):
        """The stop strings; APIError for what the model cannot honour."""
        for i, m in enumerate(getattr(self, "messages", [])):
            if m.name is not None:
                raise APIError(
                    400, f"messages.{i}.name is not supported by this server; leave it out", f"messages.{i}.name"
                )
        for key, allowed in UNSUPPORTED.items():
            value = getattr(self, key, None)
            if value not in allowed:
                raise APIError(400, f"{key}={json.dumps(value)} is not supported by this server; leave {key} out", key)
        if self.n not in (None, 1):
            raise APIError(
                400, f"n={self.n}: this server makes one choice per request; send n=1 (or leave it out)", "n"
            )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4 or not all(stops):
            raise APIError(400, "stop takes at most 4 strings, none of them empty", "stop")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(
                400, "max_tokens and max_completion_tokens differ; give one of them", "max_completion_tokens"
            )
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


# ---------------------------------------------------------------------------- what a request asks of the model


def check_model(server, name):
    if name != server.name:
        raise APIError(
            404,
            f"the model {name!r} does not exist: this server serves {server.name!r} (GET /v1/models)",
            "model",
            "model_not_found",
        )


def prompt_ids(server, body):
    """The token ids of a completion request's prompt (sample.py's rules for an empty one)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        vocab = server.vocab_size
        if not all(0 <= i < vocab for i in prompt):
            raise APIError(400, f"prompt holds a token id outside this model's vocabulary 0..{vocab - 1}", "prompt")
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, f"prompt is a list of {len(prompt)} strings: send one prompt per request", "prompt")
        prompt = prompt[0]
    try:
        ids = server.encode(prompt)
    except UserError as e:
        raise APIError(400, str(e), "prompt")
    if not ids and server.eot is None:
        raise APIError(400, "the prompt is empty; give it some text", "prompt")
    return ids or [server.eot]  # GPT-2 saw <|endoftext|> before every document: an empty prompt starts one


def chat_ids(server, body):
    """The token ids of a chat request's conversation, rendered by the model's chat template
    (OpenAI's `developer` role is the template's `system`)."""
    if server.template is None:
        raise APIError(
            400,
            f"{server.name} has no chat template, so it cannot chat: use /v1/completions, or "
            f"fine-tune it on conversations first ({server.no_chat.split(': ', 1)[-1]})",
            "messages",
        )
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    return server.template.render(messages, add_generation_prompt=True)[0]


def token_limit(server, body, n_prompt):
    """The most new tokens for this request: max_(completion_)tokens, checked against the context."""
    context = server.context
    if n_prompt >= context:
        raise APIError(
            400,
            f"the prompt is {n_prompt} tokens, longer than this model's context of {context} "
            f"tokens (with room for one new token); shorten it",
            "messages",
            "context_length_exceeded",
        )
    left = context - n_prompt
    wanted = body.max_completion_tokens or body.max_tokens
    if wanted is not None and wanted > left:
        key = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        raise APIError(
            400,
            f"{key}={wanted} is more than the {left} tokens left of the context of {context} "
            f"after the {n_prompt}-token prompt; ask for at most {left}",
            key,
            "context_length_exceeded",
        )
    return wanted or left


def check_running(server):
    """503 once the model's process is gone."""
    if server.stopped:
        raise APIError(503, server.stopped, code="engine_stopped", kind="server_error")


def start(server, body, ids, chat, stop_ids, stops):
    """The request handed to the server's model: (its id, its queue of reply items); 400 past the
    context, 429 when the server is full, 503 when its model's process is gone."""
    max_tokens = token_limit(server, body, len(ids))
    if server.full():
        cfg = server.cfg
        raise APIError(
            429,
            f"the server is full ({cfg.batch_size} requests decoding, {cfg.max_waiting} waiting); retry in a moment",
            None,
            "server_busy",
            "rate_limit_error",
            {"Retry-After": "1"},
        )
    check_running(server)
    temperature, top_p = (1.0 if x is None else x for x in (body.temperature, body.top_p))  # None: OpenAI's 1
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": body.top_k, "seed": body.seed}
    return server.start_request(ids, max_tokens, sampling, chat, stop_ids, stops)


# ---------------------------------------------------------------------------- replies


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
    rid, queue = start(server, body, ids, chat, stop_ids, stops)
    head = {
        "id": ("chatcmpl-" if chat else "cmpl-") + rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": server.name,
    }
    if not body.stream:
        item, text = await wait_done(http, server, rid, queue)
        reason = done_error(item)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}}
            if chat
            else {"index": 0, "text": text}
        )
        return {
            **head,
            "choices": [{**choice, "logprobs": None, "finish_reason": reason}],
            "usage": usage(len(ids), item[2]),
        }
    with_usage = body.stream_options is not None and body.stream_options.include_usage

    def hang_up():  # the client went away mid-stream: its row is freed at the next step, and the stream ends
        server.cancel(rid)
        queue.put_nowait(("gone",))

    return EventStream(
        events(server, rid, queue, head, chat, len(ids), with_usage),
        hang_up,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


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
                message = error if reason == "stopped" else f"the server failed while generating ({error})"
                code = "engine_stopped" if reason == "stopped" else None
                end = [f"data: {json.dumps(error_body(message, 'server_error', code=code))}\n\n"]
            else:
                end = [chunk(reason=reason)]
                if with_usage:
                    end.append(
                        f"data: {json.dumps({**head, 'choices': [], 'usage': usage(n_prompt, n_completion)})}\n\n"
                    )
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
            status, message = (
                (413, f"the body is {int(length)} bytes, more than this server's limit of {self.limit}")
                if length.isdigit()
                else (400, "the Content-Length header is not a number")
            )
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


def is_loopback(host):
    """Whether a listen address is loopback: 127.0.0.0/8, ::1 or localhost."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host):
    """The name in a Host header, as allowed_hosts holds it: 'Box.lan:8000' -> 'box.lan', '[::1]:8000' -> '::1'."""
    name = host[1:].partition("]")[0] if host.startswith("[") else host.partition(":")[0]
    return name.lower().rstrip(".")


class HostCheck:
    """ASGI middleware against DNS rebinding: a web page can point a name it owns at this machine
    (127.0.0.1, say) and then read what the server answers, as if from its own origin; the Host
    header keeps that name. So a server on a loopback address answers only a Host that names
    loopback (127.x.y.z, ::1, localhost); one on another address also any IP address (which cannot
    be rebound); either, the `names` the user allowed ('*': any). Others get 421, the status for a
    request sent to a server that does not serve its host."""

    def __init__(self, app, names, loopback):
        self.app, self.names, self.loopback = app, names, loopback

    def answers(self, name):
        if name == "localhost" or name in self.names or "*" in self.names:
            return True
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            return False
        return ip.is_loopback or not self.loopback

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not self.answers(host_name(host)):
                refused = APIError(
                    421,
                    f"Host {host!r} is not a name this server answers to (a guard against DNS rebinding): "
                    f"use {'127.0.0.1' if self.loopback else 'its IP address'} or localhost, or start serve.py with "
                    f"--allowed_hosts={host_name(host) or 'NAME'}",
                    code="host_not_allowed",
                )
                return await error_response(refused)(scope, receive, send)
        await self.app(scope, receive, send)


def add_error_handlers(app):
    """Every failure as the OpenAI error object: ours (APIError), a body that fails validation,
    one that is not JSON in UTF-8, and a bug (500, without its traceback)."""

    @app.exception_handler(APIError)
    async def api_error(_, e):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e):
        message, param = validation_message(e.errors())
        return error_response(APIError(400, message, param))

    @app.exception_handler(HTTPException)
    async def http_error(_, e):
        bad = e.__cause__  # FastAPI's "error parsing the body" from bytes that Python's json cannot decode
        if isinstance(bad, UnicodeDecodeError):
            return error_response(
                APIError(
                    400,
                    f"the body is not valid {bad.encoding.upper()} (byte {bad.start}: {bad.reason}); "
                    f"send JSON in UTF-8",
                )
            )
        return error_response(APIError(e.status_code, str(e.detail), headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def bug(_, e):
        return error_response(
            APIError(500, f"the server failed ({type(e).__name__}); please report it", kind="server_error")
        )


def api_key(cfg):
    """The key clients must send: --api_key, else the OPENAI_API_KEY environment variable ('': none)."""
    return cfg.api_key or os.environ.get("OPENAI_API_KEY", "")


def make_app(server):
    """The FastAPI app of a Server."""
    key, created = api_key(server.cfg), int(time.time())
    app = FastAPI(title="gpt-trainer serve.py", version="1", summary="OpenAI-compatible completions from one model")
    app.add_middleware(BodyLimit, limit=server.cfg.max_body)
    app.add_middleware(HostCheck, names=server.cfg.host_names(), loopback=is_loopback(server.cfg.host))  # runs first

    add_error_handlers(app)

    async def authorized(http: Request):  # async: a plain def would run in a worker thread for every request
        if key:
            scheme, _, sent = http.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(sent.strip().encode(), key.encode()):
                raise APIError(
                    401,
                    "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatRequest, http: Request):
        stops = body.check()
        check_model(server, body.model)
        ids = chat_ids(server, body)
        return await respond(http, server, body, ids, (server.template.end_id,), stops, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, http: Request):
        stops = body.check()
        check_model(server, body.model)
        ids = prompt_ids(server, body)
        stop_ids = () if server.eot is None else (server.eot,)  # sample.py's stop_at_eot
        return await respond(http, server, body, ids, stop_ids, stops, chat=False)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {
            "object": "list",
            "data": [{"id": server.name, "object": "model", "created": created, "owned_by": "gpt-trainer"}],
        }

    @app.get("/health")
    async def health():
        check_running(server)
        return {
            "status": "ok",
            "model": server.name,
            "chat": server.template is not None,
            "context": server.context,
            **server.health(),
        }

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(PAGE, media_type="text/html")

    return app
