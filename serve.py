"""Serve a model over OpenAI's API (chat and text completions, streamed or not), with a chat page;
requests in flight at the same time are decoded together, one batch per step.

    python serve.py --out_dir=out-chat-demo                       # http://127.0.0.1:8000/ : the chat page
    python serve.py --out_dir=out-shakespeare-char --port=8001    # a base model: /v1/completions
    python serve.py --init_from=gpt2 --batch_size=32              # released GPT-2 (transformers)
    python serve.py --init_from=Llama-3.2-1B-Instruct --context=4096
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

The model runs in gpt/serving.py (a process of its own by default, --engine=process) and the API
in gpt/api.py; this command listens, loads the model, and runs the app under uvicorn.
"""

import socket
import sys

import uvicorn

from configurator import ServeConfig, UserError, parse, run_main
from gpt import api, serving


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
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not server.api_key:
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
