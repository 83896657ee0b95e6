"""Sampling and generation, one batch of prompts of equal length at a time (sample.py, chat.py):
the key/value cache that makes each new token one position's work. serve.py's engine, which
decodes many requests of any length together, is engine.py's.

    from gpt.inference import sampling
    from gpt.weights import load
    model, tok_spec = load.for_inference("resume", "out-chat-demo")
    out = sampling.generate(model.eval(), idx, max_new_tokens=100, temperature=0.8, top_k=200)
    for next_id in sampling.generate_tokens(model, idx, 100, temperature=0, stop_token=eot): ...

Reads top to bottom: sampling one token, then the cache with generate and generate_tokens (the
window that slides past block_size).
"""

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------- one token


def sample_next(logits, temperature=1.0, top_k=None, top_p=1.0, generator=None):
    """One token id per row of logits (B, V): (B, 1). temperature 0 is greedy (argmax). generator:
    a torch.Generator of its own (a server's request with a seed), else the global one."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = F.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        # The nucleus: the most likely tokens, in order, until their mass reaches top_p.
        # A token is dropped when the tokens ranked above it already reach it; the most
        # likely token always stays (stable sort: ties keep argmax's choice first).
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        above = sorted_probs.cumsum(dim=-1) - sorted_probs
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(above >= top_p, 0.0))
    return torch.multinomial(probs, num_samples=1, generator=generator)


# ---------------------------------------------------------------------------- a batch of equal lengths


class KVCache:
    """Keys and values of the tokens generated so far, for every layer, so a new token
    costs one position's work instead of the whole context's. Room for `room` tokens (default
    block_size); the first `length` positions of every row are filled (each forward pass adds its
    tokens; setting it to 0 empties the cache).

    What GPT.forward asks of a cache, this one and the server's (Packed): positions(T, device),
    the positions of the T new tokens, and layer(i), layer i's view, whose attend(q, k, v, sdpa)
    stores the new keys and values and returns the attention output, masked as the cache's rows
    need, through sdpa, the layer's own scaled dot-product attention (its kernel choice)."""

    def __init__(self, config, batch_size, room=None):
        # n_kv_head heads: grouped-query attention shrinks the cache by n_head / n_kv_head
        self.room = room or config.block_size
        self.block_size = config.block_size
        self.shape = (config.n_layer, batch_size, config.n_kv_head, self.room, config.n_embd // config.n_head)
        self.k = self.v = None  # (L, B, n_kv, room, hs), made on first use in the dtype attention computes in
        self.length = 0

    def positions(self, T, device):
        """(T,): the positions of T new tokens, after the ones held; the cache counts them from here on."""
        end = self.length + T
        if end > self.room:
            raise ValueError(
                f"sequence of length {end} does not fit the cache's room of {self.room} (block_size {self.block_size})"
            )
        self.length = end
        return torch.arange(end - T, end, dtype=torch.long, device=device)

    def layer(self, i):
        return CacheLayer(self, i)

    def attend(self, i, q, k, v, sdpa):
        """Layer i: store the new keys and values (B, n_kv, T, hs) after the cached ones, and attend
        with q (B, nh, T, hs) over them all (each row's keys from position 0): (B, nh, T, hs)."""
        if self.k is None:
            self.k, self.v = (k.new_empty(self.shape) for _ in range(2))
        T, end = k.size(2), self.length  # positions() has counted the new tokens already
        start = end - T
        self.k[i, :, :, start:end], self.v[i, :, :, start:end] = k, v
        k, v = self.k[i, :, :, :end], self.v[i, :, :, :end]  # (B, n_kv, end, hs)
        if T == 1:  # one new token sees every cached key: no mask (is_causal would leave it only the first)
            return sdpa(q, k, v)
        if start == 0:  # a prompt into an empty cache: plain causal attention
            return sdpa(q, k, v, causal=True)
        # several new tokens after cached ones, a conversation's next turn: is_causal aligns its mask
        # top-left, but new token t must see every cached key and the new ones up to t
        mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(start)  # (T, end)
        return sdpa(q, k, v, mask)


class CacheLayer:
    """Layer i of a cache, as CausalSelfAttention sees it: attend(q, k, v, sdpa)."""

    def __init__(self, cache, i):
        self.cache, self.i = cache, i

    def attend(self, q, k, v, sdpa):
        return self.cache.attend(self.i, q, k, v, sdpa)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, **options):
    """Extend idx (B, T) by max_new_tokens sampled tokens -> (B, T + max_new_tokens),
    fewer when every row has met stop_token. Options as for generate_tokens. Call
    model.eval() first."""
    new = list(generate_tokens(model, idx, max_new_tokens, temperature, top_k, **options))
    return torch.cat([idx, *new], dim=1)


@torch.no_grad()
def generate_tokens(
    model,
    idx,
    max_new_tokens,
    temperature=1.0,
    top_k=None,
    top_p=1.0,
    kv_cache=True,
    window_shift=None,
    stop_token=None,
    cache=None,
):
    """Yield the next token of every row of idx (B, T), as a (B, 1) tensor, max_new_tokens times.
    temperature 0 is greedy; otherwise sample from the softmax of logits/temperature restricted to
    the top_k tokens and then to the top_p nucleus. A row that has produced stop_token goes on
    producing it, and the generator ends once every row has.

    The model sees a window of at most block_size tokens. With the cache (kv_cache=True) only each
    new token is run, attending to the cached keys/values of the others; without it the whole
    window is run for every token. Positions count from the window's start, so once the window is
    full every cached key is stale: the window then slides window_shift tokens at once and its last
    block_size - window_shift + 1 tokens are run again to refill the cache (the same tokens with or
    without the cache). window_shift=1 is nanoGPT's context (always the last block_size tokens), a
    full recompute per token past block_size; the default, block_size // 8, one every block_size // 8.

    cache, to go on from an earlier call (chat.py keeps a conversation's): a KVCache that holds
    idx[:, :cache.length] already, so only the rest of idx is run. It keeps every token given to the
    model (all the new ones but the last). It never slides: idx and the new tokens must fit its room."""
    block_size = model.config.block_size
    window_shift = window_shift or max(1, block_size // 8)
    assert 1 <= window_shift < block_size, "window_shift must be in [1, block_size)"
    if cache is None and kv_cache:
        # room for every token this call can see at once: a model with a long context (Llama 3.2's
        # 131072) sampling a few hundred tokens needs a few hundred positions, not block_size
        cache = KVCache(model.config, idx.size(0), min(block_size, idx.size(1) + max_new_tokens))
    elif cache is not None:
        assert cache.length <= idx.size(1) and idx.size(1) + max_new_tokens - 1 <= cache.room, "the cache cannot slide"
    start = max(0, idx.size(1) - block_size)  # the window is idx[:, start:]
    seen = start if cache is None else max(start, cache.length)  # tokens before this are in the cache
    done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # rows that produced stop_token
    for _ in range(max_new_tokens):
        if idx.size(1) - start > block_size:  # the window is full: slide it
            start = idx.size(1) - (block_size - window_shift + 1)
            if cache is not None:
                cache.length, seen = 0, start
        if cache is None:
            logits, _ = model(idx[:, start:])
        else:
            logits, _ = model(idx[:, seen:], cache=cache)
            seen = idx.size(1)
        next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p)  # (B, 1)
        if stop_token is not None:
            next_id = next_id.masked_fill(done[:, None], stop_token)
            done |= next_id[:, 0] == stop_token
        yield next_id
        if stop_token is not None and done.all():
            return
        idx = torch.cat((idx, next_id), dim=1)
