"""Generation: sampling and its KV cache, the batched engine, serve.py's model process and its HTTP API."""
