"""The model's side of serve.py: a Worker that owns the model and the engine that decodes every
request together (in a process of its own, or on a thread of the server's), each reply's text as
the engine makes it, and the Server the event loop holds: the tokenizer and chat template, each
request's queue of reply items, and the way to the Worker. It knows nothing of HTTP: a request
comes as token ids, a token limit and sampling settings.

    from gpt.inference import serving
    server = serving.Server(parse(ServeConfig, ["--out_dir=out-chat-demo"])).start()
    rid, queue = server.start_request(ids, 50, {"temperature": 0})  # on the event loop
    server.close()

Reads top to bottom: a reply's text (Reply), the Worker, the model's own
process and the server's end of it (EngineProcess), the Server. gpt/inference/api.py puts OpenAI's API
over a Server.
"""

import asyncio
import multiprocessing
import os
import signal
import sys
import threading
import traceback
import uuid

from configurator import UserError
from gpt.data import tokenizer
from gpt.device import cpu_matmuls, runtime
from gpt.inference.engine import Engine, Request, compile_options
from gpt.weights import load

MAX_CONTEXT = 8192  # context=0 takes the model's block_size up to this, as chat.py does


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
        model, tok_spec = load.for_inference(cfg.init_from, cfg.out_dir, cfg.checkpoint, report=print)
        block_size = model.config.block_size
        if cfg.context > block_size:
            raise UserError(f"context={cfg.context} is longer than the model's block_size={block_size}")
        context = cfg.context or min(block_size, MAX_CONTEXT)
        self.info = {"tok_spec": tok_spec, "vocab_size": model.config.vocab_size, "context": context}
        _, decode = tokenizer.load(tok_spec)
        self.decoders = {False: decode}
        try:
            self.decoders[True] = load.chat_template(
                model.config.vocab_size, tok_spec, cfg.init_from, cfg.out_dir
            ).decode
        except UserError:
            pass  # the server's side says so to a chat request
        # the weights in the dtype the model computes in (not autocast, which would cast them at every
        # step): --dtype=bfloat16 reads half the bytes per token
        model.eval().to(rt.device, rt.dtype)
        cpu_matmuls.onednn_matmuls(model)  # prompts, and every step when not compiled, on a CPU not Intel's
        self.send, self.items, self.requests = send, [], {}
        self.engine = Engine(
            model, rows=cfg.batch_size, waiting=cfg.max_waiting, room=context, device=rt.device, after_step=self.flush
        )
        if cfg.compile:
            error = self.engine.compile(**compile_options(rt.device_type))
            if error is not None:
                print(
                    f"warning: torch.compile of the decoding step failed ({error}); serving without it", file=sys.stderr
                )

    def submit(self, rid, ids, max_tokens, sampling, chat, stop_ids, stops):
        reply = Reply(self, rid, self.decoders[chat], stops)
        request = Request(ids, max_tokens, reply.on_token, reply.on_done, stop_ids=stop_ids, **sampling)
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
    """The model's process (--engine=process): a Worker, its engine on this thread, the one that loaded
    and compiled the model (Engine.run says why), and a thread reading serve.py's requests and
    cancellations. It ends when serve.py says so or is gone."""
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
    threading.Thread(target=read_requests, args=(worker, inbox), name="requests", daemon=True).start()
    worker.engine.run()


def read_requests(worker, inbox):
    """serve.py's requests and cancellations, handed to the worker, until serve.py says close or is gone."""
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
        # forked from multiprocessing's fork server, itself a fresh interpreter: no threads or device
        # state of this process are inherited (as with spawn), and where this process has a fork
        # server running already, the model's process starts without another interpreter start
        context = multiprocessing.get_context("forkserver")
        inbox, self.requests = context.Pipe(duplex=False)
        self.outputs, outbox = context.Pipe(duplex=False)
        self.process = context.Process(
            target=engine_process, args=(cfg, inbox, outbox), name="serve.py model", daemon=True
        )
        self.process.start()
        inbox.close()
        outbox.close()
        self.deliver, self.loop, self.stopped = deliver, None, None
        try:
            kind, what = self.outputs.recv()
        except EOFError:
            self.process.join()
            raise UserError(
                f"the model's process ended (exit code {self.process.exitcode}) while it loaded the model; "
                f"if it ran out of memory, try a smaller --context or --dtype=bfloat16"
            )
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

    def send(self, *message):
        """A request or a cancellation to the model's process: False once it is gone."""
        if not self.stopped:
            try:
                self.requests.send(message)
                return True
            except OSError:  # it died, and the reader has not seen the end of its pipe yet
                self._ended()
        return False

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
            self.engine, info = self.worker.engine, self.worker.info  # tests watch its steps (Engine.on_step)
        tok_spec, self.vocab_size, self.context = info["tok_spec"], info["vocab_size"], info["context"]
        try:
            self.template = load.chat_template(self.vocab_size, tok_spec, cfg.init_from, cfg.out_dir)
            self.no_chat = None
        except UserError as e:
            self.template, self.no_chat = None, str(e)
        self.encode, self.decode = tokenizer.load(tok_spec)
        self.eot = tokenizer.eot(tok_spec)

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

    @property
    def stopped(self):
        """Why the model can answer no more (its process is gone), or None while it can."""
        return None if self.process is None else self.process.stopped

    def full(self):
        """Whether every row is busy and max_waiting requests wait: a new request is refused."""
        return len(self.pending) >= self.cfg.batch_size + self.cfg.max_waiting

    def health(self):
        active = min(self.stats["active"], len(self.pending))
        return {
            "active": active,
            "waiting": len(self.pending) - active,
            "rows": self.cfg.batch_size,
            "steps": self.stats["steps"],
        }

    def start_request(self, ids, max_tokens, sampling, chat=False, stop_ids=(), stops=()):
        """Hand a request to the model's side: its prompt's token ids, the most new tokens, the
        sampling settings (Request's temperature, top_p, top_k, seed), whether its text
        is decoded as a chat reply, the token ids and strings that end it. Returns (its id, the
        queue its reply items come to: ("text", piece)..., then ("done", finish_reason, tokens, error))."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()  # uvicorn's one loop
            if self.process is not None:
                self.process.listen(self.loop)
        rid, queue = uuid.uuid4().hex, asyncio.Queue()
        self.pending[rid] = queue
        if not self.tell("submit", rid, ids, max_tokens, sampling, chat, stop_ids, stops):
            self.deliver([(rid, ("done", "stopped", 0, self.stopped))], self.stats)  # the process died just now
        return rid, queue

    def cancel(self, rid):
        """Free a request's row before the next step (a no-op once it has ended)."""
        if rid in self.pending and rid not in self.cancelled:
            self.cancelled.add(rid)
            self.tell("cancel", rid)

    def tell(self, kind, *args):
        """A request ('submit') or a cancellation ('cancel') to the model's side, wherever it runs:
        False when the model's process is gone."""
        if self.process is not None:
            return self.process.send(kind, *args)
        getattr(self.worker, kind)(*args)
        return True
