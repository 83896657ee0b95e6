"""Serve a model over OpenAI's API (chat and text completions, streamed or not), with a chat page;
requests in flight at the same time are decoded together, one batch per step.

    python serve.py --out_dir=out-chat-demo                       # http://127.0.0.1:8000/ : the chat page
    python serve.py --out_dir=out-shakespeare-char --port=8001    # a base model: /v1/completions
    python serve.py --init_from=gpt2 --batch_size=32              # released GPT-2 (transformers)
    python serve.py --init_from=Llama-3.2-1B-Instruct --context=4096
    python serve.py --out_dir=out-chat-demo --compile=True        # the decoding step compiled: faster per token
    OPENAI_API_KEY=secret python serve.py --out_dir=out-chat-demo --host=0.0.0.0   # on the network: a key
    OPENAI_API_KEY=secret python serve.py --out_dir=out-chat-demo --host=0.0.0.0 --allowed_hosts=box.lan  # http://box.lan:8000/
    python serve.py --help

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "out-chat-demo", "messages": [{"role": "user", "content": "Reverse: sule pova"}], "temperature": 0}'

Endpoints: POST /v1/chat/completions (models with a chat template), POST /v1/completions (any
model), GET /v1/models, GET /health, GET / (static/chat.html). Requests and replies have OpenAI's
shapes; a field the model cannot honour gets a 400, and every error is OpenAI's error JSON. On a
loopback address (the default) a request is answered only when its Host header names loopback
(127.0.0.1, localhost, [::1]); on another address also any IP address; on either, the names in
--allowed_hosts. Others get a 421: a web page cannot point a name it owns at this server (DNS
rebinding) and read its replies.

The model runs in gpt/inference/serving.py (a process of its own by default, --engine=process) and the API
in gpt/inference/api.py; this command listens, loads the model, and runs the app under uvicorn.
"""

import re
import socket
import sys
from dataclasses import dataclass
from typing import Literal

import uvicorn

from configurator import UserError, parse, require, require_choices, require_init_from, run_main
from gpt.inference import api, serving


@dataclass
class ServeConfig:
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    init_from: str = "resume"  # 'resume' (a checkpoint from out_dir), 'gpt2'/'gpt2-medium'/'gpt2-large'/'gpt2-xl', a Hugging Face GPT-2 or Llama directory, or another run's out_dir
    out_dir: str = "out"  # where the checkpoint is
    checkpoint: Literal["best", "latest"] = "best"  # 'best' (ckpt_best.pt or ckpt_best/ when present) or 'latest' (ckpt.pt or the newest ckpt_<iter>/)
    host: str = "127.0.0.1"  # the address to listen on; '0.0.0.0' lets anyone who can reach this machine use the model (README: serve.py)
    port: int = 8000  # the TCP port
    allowed_hosts: str = ""  # host names to answer to, comma-separated ('*': any); always answered: localhost and loopback addresses, and on a non-loopback host any IP address; other Host headers get 421 (DNS rebinding)
    api_key: str = ""  # clients must send 'Authorization: Bearer <api_key>'; '': the OPENAI_API_KEY environment variable, or none
    name: str = ""  # the model's name in the API (GET /v1/models, a request's "model"); '': out_dir's or init_from's last part
    batch_size: int = 16  # requests decoded together, at most (the batch's rows)
    max_waiting: int = 64  # requests that may wait for a row; past that a request gets 429 at once
    context: int = 0  # longest prompt + reply in tokens (the KV cache's room per row); 0: block_size, at most 8192
    max_body: int = 1_000_000  # largest request body in bytes; larger ones get 413
    device: str = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype: str = "auto"  # the weights' type: 'auto' (float32 on a CPU, bfloat16 on a GPU), 'float32', 'bfloat16', 'float16'
    compile: bool = False  # torch.compile the decoding step at start-up (CUDA graphs on a GPU); docs/serving.md
    engine: Literal["process", "thread"] = "process"  # where the model runs: 'process' (its own, beside the server's: the two use two cores) or 'thread' (serve.py's own)
    # fmt: on

    def __post_init__(self):
        require_choices(self)
        require_init_from(self.init_from, ("resume",))
        require(0 <= self.port <= 65535, f"port={self.port} must be in 0..65535 (0: any free port)")
        require(self.batch_size >= 1 and self.max_waiting >= 0, "batch_size must be at least 1 and max_waiting >= 0")
        require(self.context >= 0, f"context={self.context} must be >= 0 (0: the model's block_size)")
        require(self.max_body >= 1024, f"max_body={self.max_body} must be at least 1024 bytes")
        for name in self.host_names():
            require(
                re.fullmatch(r"[a-z0-9_.-]+|\*", name),
                f"allowed_hosts: {name!r} is not a host name; give names "
                f"alone (no scheme, port or path), comma-separated",
            )

    def host_names(self):
        """allowed_hosts as a set of names, in lower case as a Host header's are compared."""
        return {name.strip().lower().rstrip(".") for name in self.allowed_hosts.split(",") if name.strip()}


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
    server = serving.Server(cfg)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not api.api_key(cfg):
        print(
            f"warning: listening on {cfg.host} with no API key: anyone who can reach this machine can use the "
            f"model; set --api_key or OPENAI_API_KEY",
            file=sys.stderr,
        )
    what = "chat and completions" if server.template is not None else "completions only (no chat template)"
    print(
        f"serving {server.name} ({what}, context {server.context}, {cfg.batch_size} rows) on "
        f"http://{cfg.host}:{sock.getsockname()[1]}/",
        file=sys.stderr,
        flush=True,
    )
    server.start()
    http = uvicorn.Server(uvicorn.Config(api.make_app(server), log_level="warning"))
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
