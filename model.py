"""The GPT: GPT-2's architecture by default, Llama's ingredients and the speedruns' levers
(modded-nanogpt's, nanochat's: ReLU², zero-initialised projections, logit soft-capping, value
embeddings, U-net skips) by config key; attention through scaled_dot_product_attention.

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65))
    llama = GPT(GPTConfig(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, block_size=4096, vocab_size=128256,
                          pos_encoding="rope", rope_theta=500000.0, norm="rmsnorm", mlp="swiglu",
                          mlp_hidden=8192, bias=False))   # Llama-3.2-1B's shapes
    logits, loss = model(idx, targets)          # idx, targets: (B, T) int64
    out = model.generate(idx, max_new_tokens=100, temperature=0.8, top_k=200)  # nanoGPT's sampler

Reads top to bottom: the config, the small pieces the options choose between (norms,
rotary position embedding), attention, MLP, block, then the GPT with its init, optimizer
groups, FLOPs count and nanoGPT's sampler. The key/value caches, and generation that uses
them, are gpt/inference/sampling.py's and gpt/inference/engine.py's: the model asks a cache for positions and
attention, nothing more.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

# the `attention` key: which scaled_dot_product_attention kernel runs; 'auto' leaves it to PyTorch,
# which takes the first kernel that accepts the inputs in an order that depends on its version and
# the GPU (torch 2.11 on an H100 tries cuDNN first); the GPU battery reports which one ran
# (python scripts/gpu_battery.py --parts=attention)
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


@dataclass
class GPTConfig:
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    block_size: int = 1024  # longest context the position embedding covers
    vocab_size: int = 50304  # tokens the data can contain (GPT-2: 50257, padded up by nanoGPT configs)
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads (query heads)
    n_embd: int = 768  # model width: the residual stream's size
    dropout: float = 0.0  # 0 for pretraining; try 0.1+ for finetuning
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2 had
    # the options below default to GPT-2; Llama 3 is rope, rmsnorm, swiglu, n_kv_head < n_head, bias=False
    pos_encoding: str = "learned"  # 'learned' (a wpe table, GPT-2) or 'rope' (rotary, on q and k: Llama)
    rope_theta: float = 10000.0  # RoPE base: the slowest pair turns once in ~2*pi*theta positions (Llama 3: 500000)
    rope_scaling: Optional[dict] = None  # Llama 3's frequency scaling (model.rope_tables); None: plain RoPE. Llama 3.2's: {'factor': 32.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}
    norm: str = "layernorm"  # 'layernorm' (GPT-2) or 'rmsnorm' (Llama: no mean subtraction, no bias)
    norm_eps: float = 1e-5  # added to the variance in every norm (Hugging Face's layer_norm_epsilon / rms_norm_eps)
    mlp: str = "gelu"  # 'gelu', 'gelu_tanh' (GPT-2's released weights' approximation), 'swiglu' (Llama) or 'relu2': relu(x)**2 (modded-nanogpt, nanochat)
    mlp_hidden: int = 0  # MLP width; 0: 4*n_embd, or for swiglu 8/3*n_embd rounded up to a multiple of 64
    n_kv_head: int = 0  # key/value heads (grouped-query attention); 0: n_head (plain multi-head)
    qk_norm: bool = False  # RMSNorm each head's q and k before attention
    tie_embeddings: bool = True  # lm_head shares the token embedding matrix (False: two matrices)
    # speedrun levers (modded-nanogpt, nanochat), all off by default; with mlp='relu2' and the
    # Llama keys above they make the speedruns' architecture
    zero_init_proj: bool = False  # start every block's attn.c_proj and mlp.c_proj at exactly zero: each block begins as the identity (init only)
    logit_softcap: float = 0.0  # 0: off; else logits = cap * tanh(logits / cap), in float32, in training and inference alike (modded-nanogpt: 30, nanochat: 15)
    value_embeds: bool = False  # layers n_layer-1, n_layer-3, ... (every other, the last included: nanochat's) add a token embedding of their own, (vocab, n_kv_head*hs), to attention's values: v + gate * ve, one learned gate per k/v head, starting at 1
    unet_skips: bool = False  # U-net: block i's output (i < n_layer//2) is added, times a learned scalar starting at 1, to the input of its mirror block n_layer-1-i (modded-nanogpt)
    # fmt: on

    def __post_init__(self):
        # resolve the "0 means the usual" keys once, so every reader sees real sizes
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.mlp_hidden == 0:
            # SwiGLU has three matrices instead of two: 2/3 of the width keeps the parameter
            # count (and FLOPs) of the 4*n_embd GELU MLP, rounded up to suit the GPU's tiles
            self.mlp_hidden = 4 * self.n_embd if self.mlp != "swiglu" else math.ceil(8 * self.n_embd / 3 / 64) * 64
        assert self.pos_encoding in ("learned", "rope") and self.norm in ("layernorm", "rmsnorm")
        assert self.mlp in ("gelu", "gelu_tanh", "swiglu", "relu2")
        assert self.logit_softcap >= 0, "logit_softcap: 0 (off) or a positive cap"
        assert self.n_embd % self.n_head == 0 and self.n_head % self.n_kv_head == 0
        assert self.pos_encoding != "rope" or (self.n_embd // self.n_head) % 2 == 0, (
            "RoPE rotates pairs: even head size"
        )
        assert self.rope_scaling is None or self.pos_encoding == "rope"

    @property
    def padded_vocab_size(self):
        # Embedding and lm_head rows rounded up to a multiple of 64: matmul shapes that
        # suit the GPU's tiles. The extra rows are never targets and never sampled.
        return (self.vocab_size + 63) // 64 * 64


# GPT-2 in transformers: the weights stored (in, out) by its Conv1D, and its activation_function
# names -> our `mlp` ("gelu_new", the released models' choice, is GELU's tanh approximation)
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def gpt2_args(config, dropout=0.0):
    """GPTConfig keys for a transformers GPT2Config; ValueError for a setting our GPT cannot
    reproduce exactly."""
    lacking = {  # setting: whether our GPT lacks it
        f"activation_function={config.activation_function!r}": config.activation_function not in GPT2_ACTIVATIONS,
        "scale_attn_weights=False": not config.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx=True": config.scale_attn_by_inverse_layer_idx,
        "add_cross_attention=True": config.add_cross_attention,
    }
    unsupported = [setting for setting, lacks in lacking.items() if lacks]
    if unsupported:
        raise ValueError(f"this GPT-2 has {', '.join(unsupported)}, which this trainer's GPT does not implement")
    return dict(
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        block_size=config.n_positions,
        vocab_size=config.vocab_size,
        dropout=dropout,
        bias=True,  # GPT-2 has biases everywhere
        mlp=GPT2_ACTIVATIONS[config.activation_function],
        mlp_hidden=config.n_inner or 4 * config.n_embd,
        norm_eps=config.layer_norm_epsilon,
        tie_embeddings=config.tie_word_embeddings,
    )


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm with its gain cast to the input's dtype. Under bf16 autocast the input is bf16
    and a float32 gain sends torch's rms_norm to its unfused path, which computes and keeps
    float32 intermediates (it warns "Mismatch dtype between input and weight ... Cannot dispatch
    to fused implementation"); with the dtypes equal CUDA runs its fused kernel. In float32 the
    cast returns the gain itself: the same numbers as nn.RMSNorm, bit for bit."""

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


def make_norm(config, dim):
    """The pre-norm of a block (and the final one): LayerNorm as GPT-2, or RMSNorm as Llama
    (x / rms(x) * weight: cheaper, and as good in practice)."""
    if config.norm == "rmsnorm":
        return RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


def has_value_embed(config, i):
    """Whether layer i mixes a value embedding into its values: with value_embeds, every other
    layer counting back from the last (the last always), as nanochat: half the tables' memory for
    most of the gain."""
    return config.value_embeds and i % 2 == (config.n_layer - 1) % 2


def rope_tables(head_size, length, theta, scaling=None):
    """cos and sin (length, head_size/2) of RoPE's angles: position p turns dims (i, i + hs/2)
    by p * theta^(-2i/hs), fast rotations for the first pairs, slow ones for the last.

    scaling, Llama 3's (3.1, 3.2) way to stretch a model trained on original_max_position_embeddings
    tokens to a longer context: pairs that turn fewer than low_freq_factor times over the original
    context turn `factor` times slower, pairs that turn more than high_freq_factor times are left
    alone (they encode local order), and the ones in between move smoothly from one to the other."""
    inv_freq = theta ** -(torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)  # (hs/2,)
    if scaling is not None:
        turns = scaling["original_max_position_embeddings"] * inv_freq / (2 * math.pi)  # over the original context
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        keep = ((turns - low) / (high - low)).clamp(0, 1)  # 0: slowed down fully, 1: unchanged
        inv_freq = inv_freq * (keep + (1 - keep) / scaling["factor"])
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (length, hs/2)
    return angles.cos(), angles.sin()


def document_mask(docs, flex=False):
    """The attention mask of packed documents: docs (B, T), each token's document number in its
    row -> a boolean (B, 1, T, T), True where a query may see a key: the same document, and not
    later. flex: FlexAttention's BlockMask of the same mask instead (the CUDA kernel: it skips the
    blocks a row's documents never see, and never builds T x T)."""
    B, T = docs.shape
    if flex:
        same_doc_causal = lambda b, h, q, k: (docs[b, q] == docs[b, k]) & (q >= k)
        return create_block_mask(same_doc_causal, B, None, T, T, device=docs.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal).unsqueeze(1)


def document_positions(docs):
    """docs (B, T) -> each token's position in its own document (B, T): a document packed
    after others is embedded as if it began its row."""
    t = torch.arange(docs.size(1), device=docs.device).expand_as(docs)
    first = torch.ones_like(docs, dtype=torch.bool)
    first[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return t - torch.where(first, t, 0).cummax(dim=1).values


def apply_rope(x, cos, sin):
    """Rotate x (B, nh, T, hs) by the angles of its positions, (1, T, hs/2) or one row each
    (B, 1, T, hs/2). Pairs are (i, i + hs/2), the layout of Hugging Face's Llama weights. A
    rotation of q by m and k by n leaves q.k depending on m - n only: attention sees relative
    positions."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, value_embed=False):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_size = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.attention = "auto"  # a key of SDPA_BACKENDS, or 'auto'; GPT.set_attention sets it
        # grouped-query attention: fewer k/v heads, each shared by a group of q heads
        kv_size = self.n_kv_head * self.head_size
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * kv_size, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            # RMSNorm of each head's q and k (as nanochat and modded-nanogpt do, here with a
            # learned gain): the attention logits cannot grow with the weights, which steadies
            # training at high learning rates
            self.q_norm = RMSNorm(self.head_size, eps=config.norm_eps)
            self.k_norm = RMSNorm(self.head_size, eps=config.norm_eps)
        if value_embed:  # value_embeds: how much of the token's value embedding each k/v head takes
            self.ve_gate = nn.Parameter(torch.ones(self.n_kv_head))  # (n_kv,)

    def forward(self, x, rope=None, cache=None, mask=None, ve=None):
        """x (B, T, C). rope: the (cos, sin) tables of these T positions, (1, T, hs/2) or per row
        (B, 1, T, hs/2), when the model uses RoPE. mask: document_mask's, for packed documents
        (None: causal over the whole row). cache, when generating (sampling.py, engine.py): this
        layer's view of a key/value cache, which stores the new keys and values beside the ones it
        holds and runs attention over them, masked as its rows need. ve (B, T, n_kv*hs): the value
        embedding of these tokens (value_embeds), added to v before v is used or cached."""
        B, T, C = x.size()
        hs = self.head_size
        q, k, v = self.c_attn(x).split([C, self.n_kv_head * hs, self.n_kv_head * hs], dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        if ve is not None:  # value embeddings (ResFormer, nanochat): the token's identity straight into v
            v = v + (self.ve_gate.view(-1, 1) * ve.view(B, T, self.n_kv_head, hs)).flatten(2)
        k, v = (t.view(B, T, self.n_kv_head, hs).transpose(1, 2) for t in (k, v))  # (B, n_kv, T, hs)
        if self.qk_norm:  # before the rotation, as in Qwen3 and OLMo 2
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if isinstance(mask, BlockMask):  # CUDA's document mask (GPT.forward)
            y = flex_attention(q, k, v, block_mask=mask, enable_gqa=k.size(1) != self.n_head)
        elif cache is None:
            y = self.attend(q, k, v, mask, causal=mask is None)  # each token sees itself and the tokens before it
        else:
            y = cache.attend(q, k, v, self.attend)  # (B, nh, T, hs), through this layer's kernel choice
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q, k, v, mask=None, causal=False):
        """Scaled dot-product attention of q (B, nh, T, hs) over k, v (B, n_kv, S, hs): (B, nh, T, hs).
        mask: a boolean (.., T, S) of the keys each query sees, or causal=True for the usual
        lower triangle (top-left aligned)."""
        groups = self.n_head // self.n_kv_head
        if groups > 1 and q.dtype == torch.float32 and q.device.type != "cpu":
            # GPU kernels share k/v heads in half precision only; in float32 SDPA would fall back
            # to its unfused path (T x T scores in memory), so give it whole heads instead
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # flash attention where the device has it; is_causal masks the future without building a
        # mask; enable_gqa lets each k/v head serve its group of q heads without copying it
        with sdpa_kernel(SDPA_BACKENDS[self.attention]) if self.attention != "auto" else nullcontext():
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=causal,
                enable_gqa=k.size(1) != self.n_head,
            )


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.kind, hidden = config.mlp, config.mlp_hidden
        # SwiGLU's gate and up projections are one matmul (c_fc), its down projection is c_proj
        self.c_fc = nn.Linear(config.n_embd, 2 * hidden if self.kind == "swiglu" else hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        h = self.c_fc(x)  # (B, T, hidden), for SwiGLU (B, T, 2 * hidden): gate then up
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up  # (B, T, hidden)
        elif self.kind == "relu2":  # sparse and cheap, and better than GELU in modded-nanogpt's speedruns
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh" if self.kind == "gelu_tanh" else "none")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config, i=0):
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config, has_value_embed(config, i))
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, rope=None, cache=None, mask=None, ve=None):
        # pre-norm: the residual stream itself is never normalized, which keeps deep stacks trainable
        x = x + self.attn(self.ln_1(x), rope, cache, mask, ve)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        C = config.n_embd
        layers = dict(wte=nn.Embedding(config.padded_vocab_size, C))
        if config.pos_encoding == "learned":
            layers["wpe"] = nn.Embedding(config.block_size, C)
        layers.update(
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=make_norm(config, C),
        )
        if config.value_embeds:  # value_embeds: a (vocab, n_kv*hs) table per layer that has one, keyed by its index
            kv_size = config.n_kv_head * (C // config.n_head)
            layers["ve"] = nn.ModuleDict(
                {
                    str(i): nn.Embedding(config.padded_vocab_size, kv_size)
                    for i in range(config.n_layer)
                    if has_value_embed(config, i)
                }
            )
        self.transformer = nn.ModuleDict(layers)
        if config.unet_skips:  # the weight of block i's output in the input of block n_layer-1-i
            self.skip_weights = nn.Parameter(torch.ones(config.n_layer // 2))
        self.lm_head = nn.Linear(C, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # one matrix embeds and un-embeds
        if config.pos_encoding == "rope":
            # computed, not learned: kept out of checkpoints and parameter counts (persistent=False)
            cos, sin = rope_tables(C // config.n_head, config.block_size, config.rope_theta, config.rope_scaling)
            self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, hs/2)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2: each block adds two projections to the residual stream (SwiGLU's down projection
        # is one), so scale them down to keep its variance from growing with depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
                if config.zero_init_proj:
                    # each block starts as the identity and the residual stream as the embedding
                    # (modded-nanogpt, nanochat); c_proj's gradient, h^T dy, is not zero, so it learns
                    nn.init.zeros_(p)
        # recompute each block's activations in backward instead of keeping them: less memory for
        # long contexts, about a third more compute (gpt/train/build.py's build() sets it from
        # activation_checkpointing)
        self.activation_checkpointing = False

    def set_attention(self, name):
        """Run every layer's attention with one SDPA kernel ('flash', 'cudnn', 'efficient', 'math'),
        or let PyTorch choose ('auto'). A kernel that cannot take the inputs fails in forward
        (gpt/train/build.py's attention_error() checks first)."""
        assert name == "auto" or name in SDPA_BACKENDS, name
        for block in self.transformer.h:
            block.attn.attention = name

    def _init_weights(self, module):
        # norms keep their own init: weight 1, bias 0
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=True):
        """Parameters, counting a tied matrix once. non_embedding (the default) leaves out the
        lookup tables, which do no matmul work: this is the N of the FLOPs count. That drops the
        position embeddings, and the token embedding when it is not tied (lm_head, a matmul,
        always counts; tied, it is the same matrix)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.transformer.wte.weight.numel()
            if "ve" in self.transformer:  # value embeddings: lookups too
                n -= sum(p.numel() for p in self.transformer.ve.parameters())
        return n

    def forward(self, idx, targets=None, cache=None, logits_at=None, reduction="mean", docs=None, loss_only=False):
        """idx (B, T) -> (logits, loss). With targets, loss is the mean cross-entropy over the
        targets that are not -1 (reduction='sum': their sum, for chat batches, which weigh
        micro-batches by their trained tokens). The logits are every position's with targets, else
        the last position's only (all that sampling needs); logits_at='all' asks for every
        position's, and a tensor (N,) of positions in the flattened (B*T) batch for those alone,
        (N, vocab) (eval scores a few tokens per row: un-embedding the others would be most of its
        work). cache, when generating (sampling.py's, engine.py's caches): idx continues the tokens the cache
        holds; cache.positions gives the new tokens' positions, and cache.layer(i) stores layer i's
        keys and values and runs its attention over them (CausalSelfAttention.forward). docs (B, T),
        for rows packed from documents (gpt/data/batches.py): each token's document number in its row;
        a token then sees only its own document, whose positions start at 0, as if it ran alone.
        With logit_softcap the logits are capped (and float32) on every path, the loss's included.
        loss_only, with targets: (None, loss), for a step that never reads the logits. They then stay
        inside the loss, so a compiled step need not write them out ((B, T, vocab), in float32 with
        logit_softcap): inductor may fuse the cap into the cross-entropy's kernels."""
        B, T = idx.size()
        mask = None
        if cache is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of length {T} is longer than block_size {self.config.block_size}")
            pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
            if docs is not None:  # (B, T) positions, and a mask to keep each document to itself
                flex = docs.is_cuda and not (self.training and self.config.dropout > 0)  # FlexAttention has no dropout
                pos, mask = document_positions(docs), document_mask(docs, flex)
        else:
            pos = cache.positions(T, idx.device)  # (T,), or (B, T) when every row has its own positions
        x, rope = self.transformer.wte(idx), None  # (B, T, C)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        else:  # (1, T, hs/2) or (B, 1, T, hs/2) each: broadcast over the heads
            rope = (self.rope_cos[pos].unsqueeze(-3), self.rope_sin[pos].unsqueeze(-3))
        # the blocks, in forward itself: under FSDP2 dynamo leaves this frame eager and compiles each
        # block's own; a helper method here would be one more frame, broken at every block's hooks.
        # value_embeds: each table's rows for these tokens go to its layer's attention. unet_skips:
        # the first half's outputs are kept, and the second half takes them back in mirror order
        # (block n-1-i block i's output), so late blocks see early features without their having to
        # survive the blocks in between; a cached step skips within its new tokens
        x, n, skips = self.transformer.drop(x), self.config.n_layer, []
        ves = self.transformer["ve"] if "ve" in self.transformer else {}
        for i, block in enumerate(self.transformer.h):
            if self.config.unet_skips and i >= n - n // 2:
                x = x + self.skip_weights[n - 1 - i] * skips.pop()
            ve = ves[str(i)](idx) if str(i) in ves else None  # (B, T, n_kv*hs)
            if cache is not None:
                x = block(x, rope, cache.layer(i), ve=ve)
            elif self.activation_checkpointing and self.training:
                x = checkpoint(block, x, rope, None, mask, ve, use_reentrant=False)  # dropout masks replay exactly
            else:
                x = block(x, rope, None, mask, ve)
            if self.config.unet_skips and i < n // 2:
                skips.append(x)
        x = self.transformer.ln_f(x)
        if torch.is_tensor(logits_at):
            x = x.flatten(0, 1).index_select(0, logits_at)  # (N, C)
        elif targets is None and logits_at != "all":
            x = x[:, [-1], :]  # (B, 1, C)
        logits = self.lm_head(x)[..., : self.config.vocab_size]  # drop the padding rows
        if self.config.logit_softcap:  # squash smoothly into (-cap, cap): no logit runs away
            cap = self.config.logit_softcap  # in float32 at least: in bfloat16, tanh's steps near +-cap are coarse
            logits = cap * torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / cap)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1, reduction=reduction
            )
        return (None if loss_only and loss is not None else logits), loss

    def crop_block_size(self, block_size):
        """Shorten the context (e.g. to finetune a 1024-token model on 256-token blocks)."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        if "wpe" in self.transformer:
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        else:
            self.rope_cos, self.rope_sin = self.rope_cos[:block_size], self.rope_sin[:block_size]

    def add_tokens(self, ids):
        """Start the rows of tokens `ids` (new to these weights, e.g. chat turn tokens) afresh,
        taking padding rows into use where they lie past vocab_size. Each row of the embedding
        (and of an untied lm_head) becomes the mean of the other rows of the vocabulary: an
        average token, which neither dominates the softmax nor stands out in the residual stream,
        as a random or zero row could."""
        vocab_size = max(self.config.vocab_size, max(ids) + 1)
        assert vocab_size <= self.config.padded_vocab_size, "only the padding rows can be taken"
        others = torch.ones(self.config.vocab_size, dtype=torch.bool)
        others[[i for i in ids if i < self.config.vocab_size]] = False
        with torch.no_grad():
            for weight in {self.transformer.wte.weight, self.lm_head.weight}:  # one matrix when tied
                weight[list(ids)] = weight[: self.config.vocab_size][others.to(weight.device)].mean(dim=0)
        self.config.vocab_size = vocab_size

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        """nanoGPT's: a GPT with GPT-2's released weights, model_type 'gpt2', 'gpt2-medium',
        'gpt2-large' or 'gpt2-xl' (or a local Hugging Face GPT-2 directory), read by transformers
        from its cache or the hub. override_args may set dropout, as in nanoGPT. (gpt/weights/load.py reads
        the same weights with one-line errors, and Llama's too.)"""
        override_args = override_args or {}
        assert set(override_args) <= {"dropout"}, "only dropout can be overridden"
        from transformers import GPT2LMHeadModel  # optional dependency: only this needs it

        return cls.from_gpt2(GPT2LMHeadModel.from_pretrained(model_type), **override_args)

    @classmethod
    def from_gpt2(cls, hf_model, dropout=0.0):
        """A transformers GPT2LMHeadModel's weights in our GPT; the logits agree to float32
        rounding. Every weight has the same name on both sides; Hugging Face's Conv1D keeps a
        Linear's weight as (in, out), ours is (out, in), so those are transposed, and our
        embedding's padding rows (vocab_size up to a multiple of 64) stay zero."""
        model = cls(GPTConfig(**gpt2_args(hf_model.config, dropout)))
        theirs = {k: v for k, v in hf_model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        ours = model.state_dict()
        # every weight copied: a renamed or new module fails here, not silently
        assert ours.keys() == theirs.keys(), f"weights without a counterpart: {sorted(ours.keys() ^ theirs.keys())}"
        with torch.no_grad():
            for key, dst in ours.items():
                src = theirs[key].t() if key.endswith(GPT2_CONV1D) else theirs[key]
                if key in ("transformer.wte.weight", "lm_head.weight"):  # (vocab_size, C) into (padded, C)
                    dst.zero_()
                    dst = dst[: src.size(0)]
                dst.copy_(src)  # raises on a shape mismatch, and casts (e.g. float16 files) to float32
        return model

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, params=None):
        """AdamW over `params` (default: all of them) with weight decay on matrices and
        embeddings only: decaying biases and norm gains toward zero only hurts."""
        params = [p for p in (self.parameters() if params is None else params) if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # the fused kernel updates every parameter in one launch. Not on MPS: its kernel ignored
        # found_inf (pytorch#186360, 2026), so a skipped non-finite step would still update the weights
        fused = device_type in ("cuda", "cpu")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    def flops_per_token(self):
        """Training FLOPs per token: 6N for the matmuls with the weights (2 forward, 4
        backward), N from num_params() (so GQA's smaller k/v projections, SwiGLU's three
        matrices and an untied lm_head are counted as they are), plus 12*L*H*Q*T for
        attention's two (T x Q) score and value matmuls per query head: shared k/v heads
        save no attention FLOPs."""
        c = self.config
        L, H, Q, T = c.n_layer, c.n_head, c.n_embd // c.n_head, c.block_size
        return 6 * self.num_params() + 12 * L * H * Q * T

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """nanoGPT's sampler: idx (B, T) extended by max_new_tokens tokens, each drawn from the
        softmax of the last position's logits / temperature (restricted to the top_k most likely).
        The whole context (its last block_size tokens) runs for every token; gpt/inference/sampling.py's
        generate is the fast one (a key/value cache), with greedy decoding, top_p and stop tokens."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature  # (B, vocab)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
