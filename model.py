"""The GPT: GPT-2's architecture, attention through scaled_dot_product_attention.

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65))
    logits, loss = model(idx, targets)          # idx, targets: (B, T) int64
    out = model.generate(idx, max_new_tokens=100, temperature=0.8, top_k=200, top_p=0.95)

Reads top to bottom: attention, MLP, block, then the GPT with its init, optimizer
groups, FLOPs count and sampling; last, the key/value cache that makes sampling fast.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest context the position embedding covers
    vocab_size: int = 50304  # tokens the data can contain (GPT-2: 50257, padded up by nanoGPT configs)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2 had

    @property
    def padded_vocab_size(self):
        # Embedding and lm_head rows rounded up to a multiple of 64: matmul shapes that
        # suit the GPU's tiles. The extra rows are never targets and never sampled.
        return (self.vocab_size + 63) // 64 * 64


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv=None):
        """x (B, T, C). kv, when generating with a KVCache: a function that stores this
        layer's new keys/values after the cached ones and returns them all."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        causal = True  # training, and several new tokens filling an empty cache
        if kv is not None:
            k, v = kv(k, v)  # (B, nh, cached + T, hs)
            if T == 1:  # one new token sees every cached key: no mask (is_causal would leave it only the first)
                causal = False
            else:
                assert k.size(2) == T, "several new tokens after cached ones would need an explicit mask"
        # flash attention where the device has it; is_causal masks the future without building a mask
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=causal)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv=None):
        # pre-norm: the residual stream itself is never normalized, which keeps deep stacks trainable
        x = x + self.attn(self.ln_1(x), kv)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied: one matrix embeds and un-embeds
        self.apply(self._init_weights)
        # GPT-2: each block adds two projections to the residual stream, so scale them down
        # to keep its variance from growing with depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameters, counting the tied matrix once; without the position embeddings by
        default, since they do no matmul work (this is the N in the FLOPs count)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, all_logits=False, cache=None):
        """idx (B, T) -> (logits, loss). With targets, logits cover every position and loss
        is the mean cross-entropy; without, only the last position's logits are computed
        (all that sampling needs) unless all_logits=True. With a KVCache, idx continues the
        tokens already in it (at positions cache.length onward) and is added to it."""
        B, T = idx.size()
        start = 0 if cache is None else cache.length
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of length {start + T} is longer than block_size {self.config.block_size}")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            x = block(x, None if cache is None else cache.layer(i))
        if cache is not None:
            cache.length += T
        x = self.transformer.ln_f(x)
        if targets is None and not all_logits:
            x = x[:, [-1], :]  # (B, 1, C)
        logits = self.lm_head(x)[..., : self.config.vocab_size]  # drop the padding rows
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def crop_block_size(self, block_size):
        """Shorten the context (e.g. to finetune a 1024-token model on 256-token blocks)."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on matrices and embeddings only: decaying biases and
        norm gains toward zero only hurts."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # the fused kernel updates every parameter in one launch; CPU, CUDA and MPS have it
        fused = device_type in ("cuda", "cpu", "mps")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    def flops_per_token(self):
        """Training FLOPs per token: 6N for the matmuls with the weights (2 forward, 4
        backward), N excluding the position embeddings, plus 12*L*H*Q*T for attention's
        two (T x Q) score and value matmuls per head."""
        c = self.config
        L, H, Q, T = c.n_layer, c.n_head, c.n_embd // c.n_head, c.block_size
        return 6 * self.num_params() + 12 * L * H * Q * T

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, **options):
        """Extend idx (B, T) by max_new_tokens sampled tokens -> (B, T + max_new_tokens),
        fewer when every row has met stop_token. Options as for generate_tokens. Call
        model.eval() first."""
        new = list(self.generate_tokens(idx, max_new_tokens, temperature, top_k, **options))
        return torch.cat([idx, *new], dim=1)

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=1.0, kv_cache=True,
                        window_shift=1, stop_token=None):
        """Yield the next token of every row of idx (B, T), as a (B, 1) tensor, max_new_tokens
        times. temperature 0 is greedy; otherwise sample from the softmax of logits/temperature
        restricted to the top_k tokens and then to the top_p nucleus. A row that has produced
        stop_token goes on producing it, and the generator ends once every row has.

        The model sees at most the last block_size tokens. Without the cache each token runs
        the whole (cropped) context through the model. With it (kv_cache=True) only the new
        token is run, attending to the cached keys/values of the others, until the cache holds
        block_size tokens. Positions are absolute, so past that point every key changes as
        the window slides: the window moves window_shift tokens at once and the last
        block_size - window_shift + 1 tokens are run again to refill the cache. With
        window_shift=1 (the default) that happens for every token: each token sees the last
        block_size tokens, as without the cache, at the cost of no cache. A larger shift
        recomputes that often less, and each token then sees between block_size -
        window_shift + 1 and block_size tokens."""
        block_size = self.config.block_size
        assert 1 <= window_shift < block_size or not kv_cache, "window_shift must be in [1, block_size)"
        cache = KVCache(self.config, idx.size(0)) if kv_cache else None
        pending = idx[:, -block_size:]  # the tokens the model has not seen yet
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)  # rows that produced stop_token
        for _ in range(max_new_tokens):
            if cache is None:
                logits, _ = self(idx[:, -block_size:])
            else:
                if cache.length + pending.size(1) > block_size:  # no position left: slide the window
                    cache.length = 0
                    pending = idx[:, -(block_size - window_shift + 1) :]
                logits, _ = self(pending, cache=cache)
            next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p)  # (B, 1)
            if stop_token is not None:
                next_id = next_id.masked_fill(done[:, None], stop_token)
                done |= next_id[:, 0] == stop_token
            yield next_id
            if stop_token is not None and done.all():
                return
            idx, pending = torch.cat((idx, next_id), dim=1), next_id


def sample_next(logits, temperature=1.0, top_k=None, top_p=1.0):
    """One token id per row of logits (B, V): (B, 1). temperature 0 is greedy (argmax)."""
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
    return torch.multinomial(probs, num_samples=1)


class KVCache:
    """Keys and values of the tokens generated so far, for every layer, so a new token
    costs one position's work instead of the whole context's. Room for block_size tokens;
    the first `length` positions are filled (GPT.forward advances it; setting it to 0
    empties the cache)."""

    def __init__(self, config, batch_size):
        self.shape = (config.n_layer, batch_size, config.n_head, config.block_size, config.n_embd // config.n_head)
        self.k = self.v = None  # (L, B, nh, block_size, hs), made on first use in the dtype attention computes in
        self.length = 0

    def layer(self, i):
        """The `kv` function CausalSelfAttention calls for layer i."""

        def store_and_get(k, v):  # (B, nh, T, hs) each -> (B, nh, length + T, hs) each
            if self.k is None:
                self.k, self.v = (k.new_empty(self.shape) for _ in range(2))
            end = self.length + k.size(2)
            self.k[i, :, :, self.length : end] = k
            self.v[i, :, :, self.length : end] = v
            return self.k[i, :, :, :end], self.v[i, :, :, :end]

        return store_and_get
