"""This trainer's GPT as a Hugging Face model class, for the models neither GPT2LMHeadModel nor
LlamaForCausalLM computes (the speedrun recipe: ReLU², logit soft-cap, value embeddings, U-net
skips, q/k norm, and any mix of model.py's options). hf.py copies this file beside the weights
and names it in config.json's auto_map, so the directory loads without this repository:

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("out-shakespeare-char-cpu/hf", trust_remote_code=True)
    out = model.generate(ids, max_new_tokens=50, do_sample=False)   # greedy, with a key/value cache

It depends on torch and transformers only (it is read on machines that have neither this repo nor
its model.py), and computes what model.py's GPT computes, in the same order and with the same
module and weight names (transformer.wte, transformer.h.0.attn.c_attn, ...), so its logits equal
ours to float32 rounding. Inference only: no dropout, and no packed-document masks. The model sees
at most block_size (max_position_embeddings) positions, as ours does; generating past them is
refused (sample.py slides its window instead). Read by transformers 4.57 and 5.24 alike.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 5.24 renamed the cache argument and output `past_key_values` to `cache`
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class GPTTrainerConfig(PretrainedConfig):
    """model.py's GPTConfig keys, under their own names; the Hugging Face names that generate()
    and the caches read map onto them. rope_frequency_scaling is GPTConfig's rope_scaling (Llama
    3's dict), renamed because transformers reserves rope_scaling for its own format."""

    model_type = "gpt_trainer"
    attribute_map = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "num_key_value_heads": "n_kv_head",
        "max_position_embeddings": "block_size",
    }

    def __init__(
        self,
        vocab_size=65,
        block_size=1024,
        n_layer=12,
        n_head=12,
        n_kv_head=12,
        n_embd=768,
        bias=True,
        pos_encoding="learned",
        rope_theta=10000.0,
        rope_frequency_scaling=None,
        norm="layernorm",
        norm_eps=1e-5,
        mlp="gelu",
        mlp_hidden=3072,
        qk_norm=False,
        logit_softcap=0.0,
        value_embeds=False,
        unet_skips=False,
        tie_word_embeddings=True,
        **kwargs,
    ):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_kv_head, self.n_embd = n_layer, n_head, n_kv_head, n_embd
        self.bias, self.pos_encoding, self.rope_theta = bias, pos_encoding, rope_theta
        self.rope_frequency_scaling = rope_frequency_scaling
        self.norm, self.norm_eps, self.mlp, self.mlp_hidden, self.qk_norm = norm, norm_eps, mlp, mlp_hidden, qk_norm
        self.logit_softcap, self.value_embeds, self.unet_skips = logit_softcap, value_embeds, unet_skips
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def rope_inv_freq(c):
    """RoPE's angle per position of each pair (i, i + hs/2) of a head, (hs/2,), with Llama 3's
    frequency scaling when the config has it (model.py's rope_tables)."""
    hs = c.n_embd // c.n_head
    inv_freq = c.rope_theta ** -(torch.arange(0, hs, 2, dtype=torch.float32) / hs)
    s = c.rope_frequency_scaling
    if s:
        turns = s["original_max_position_embeddings"] * inv_freq / (2 * math.pi)
        keep = ((turns - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])).clamp(0, 1)
        inv_freq = inv_freq * (keep + (1 - keep) / s["factor"])
    return inv_freq


def apply_rope(x, cos, sin):
    """x (B, nh, T, hs) turned by (B, 1, T, hs/2) angles; pairs (i, i + hs/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def make_norm(c, dim):
    return nn.RMSNorm(dim, eps=c.norm_eps) if c.norm == "rmsnorm" else nn.LayerNorm(dim, eps=c.norm_eps, bias=c.bias)


def has_value_embed(c, i):
    # every other layer counting back from the last, which always has one
    return c.value_embeds and i % 2 == (c.n_layer - 1) % 2


class CausalSelfAttention(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_size, self.layer = c.n_head, c.n_kv_head, c.n_embd // c.n_head, i
        kv = self.n_kv_head * self.head_size
        self.c_attn = nn.Linear(c.n_embd, c.n_embd + 2 * kv, bias=c.bias)  # q, k, v
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        if c.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_size, eps=c.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_size, eps=c.norm_eps)
        if has_value_embed(c, i):
            self.ve_gate = nn.Parameter(torch.ones(self.n_kv_head))  # (n_kv,)

    def forward(self, x, rope, ve, cache, mask):
        B, T, C = x.size()
        hs, n_kv = self.head_size, self.n_kv_head
        q, k, v = self.c_attn(x).split([C, n_kv * hs, n_kv * hs], dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        if ve is not None:  # the token's value embedding, into v before it is used or cached
            v = v + (self.ve_gate.view(-1, 1) * ve.view(B, T, n_kv, hs)).flatten(2)
        k, v = (t.view(B, T, n_kv, hs).transpose(1, 2) for t in (k, v))  # (B, n_kv, T, hs)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:  # the keys and values of every position so far: (B, n_kv, S, hs)
            k, v = cache.update(k, v, self.layer)
        if n_kv != self.n_head:  # each k/v head serves its group of query heads
            k, v = (t.repeat_interleave(self.n_head // n_kv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.kind = c.mlp
        self.c_fc = nn.Linear(c.n_embd, 2 * c.mlp_hidden if c.mlp == "swiglu" else c.mlp_hidden, bias=c.bias)
        self.c_proj = nn.Linear(c.mlp_hidden, c.n_embd, bias=c.bias)

    def forward(self, x):
        h = self.c_fc(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh" if self.kind == "gelu_tanh" else "none")
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        self.ln_1, self.attn = make_norm(c, c.n_embd), CausalSelfAttention(c, i)
        self.ln_2, self.mlp = make_norm(c, c.n_embd), MLP(c)

    def forward(self, x, rope, ve, cache, mask):
        x = x + self.attn(self.ln_1(x), rope, ve, cache, mask)
        return x + self.mlp(self.ln_2(x))


class GPTTrainerForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = GPTTrainerConfig
    base_model_prefix = "transformer"
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}  # used when tie_word_embeddings

    def __init__(self, config):
        super().__init__(config)
        c = config
        layers = dict(wte=nn.Embedding(c.vocab_size, c.n_embd))
        if c.pos_encoding == "learned":
            layers["wpe"] = nn.Embedding(c.block_size, c.n_embd)
        layers.update(h=nn.ModuleList([Block(c, i) for i in range(c.n_layer)]), ln_f=make_norm(c, c.n_embd))
        if c.value_embeds:
            kv = c.n_kv_head * (c.n_embd // c.n_head)
            ve = {str(i): nn.Embedding(c.vocab_size, kv) for i in range(c.n_layer) if has_value_embed(c, i)}
            layers["ve"] = nn.ModuleDict(ve)
        self.transformer = nn.ModuleDict(layers)
        if c.unet_skips:
            self.skip_weights = nn.Parameter(torch.ones(c.n_layer // 2))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        # only for weights a directory lacks: exported directories hold every one
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None, logits_to_keep=0, **kwargs):
        """input_ids (B, T) -> logits (B, T, vocab), in float32 with the soft-cap. With a cache
        (kwargs' cache or past_key_values: generate() makes a DynamicCache) input_ids continue the
        tokens it holds. attention_mask (B, S):
        0 for keys no query may see (padding); positions count from the cache's length unless
        position_ids (B, T) are given."""
        c, (B, T) = self.config, input_ids.shape
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
        if int(position_ids.max()) >= c.block_size:
            raise ValueError(f"position {int(position_ids.max())} is past this model's block_size={c.block_size}")
        mask = None  # None: causal, in SDPA's own kernel
        if past or (attention_mask is not None and not attention_mask.all()):
            S = past + T  # the new queries are the last T of the S positions
            mask = torch.ones(T, S, dtype=torch.bool, device=input_ids.device).tril(S - T)[None, None]
            if attention_mask is not None:
                mask = mask & attention_mask[:, None, None, -S:].bool()  # (B, 1, T, S)
        x, rope = self.transformer.wte(input_ids), None  # (B, T, C)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(position_ids)
        else:  # (B, 1, T, hs/2) each, as model.py's tables would give
            angles = position_ids.float()[..., None] * rope_inv_freq(c).to(x.device)
            rope = (angles.cos()[:, None].to(x.dtype), angles.sin()[:, None].to(x.dtype))
        n, skips = c.n_layer, []
        ves = self.transformer["ve"] if "ve" in self.transformer else {}
        for i, block in enumerate(self.transformer.h):
            if c.unet_skips and i >= n - n // 2:  # block i's input takes block n-1-i's output back
                x = x + self.skip_weights[n - 1 - i] * skips.pop()
            x = block(x, rope, ves[str(i)](input_ids) if str(i) in ves else None, cache, mask)
            if c.unet_skips and i < n // 2:
                skips.append(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        if c.logit_softcap:
            logits = c.logit_softcap * torch.tanh(logits.float() / c.logit_softcap)
        loss = None
        if labels is not None:  # Hugging Face's convention: labels are input_ids, shifted here
            shifted = logits[:, :-1].reshape(-1, logits.size(-1)).float()
            loss = F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
