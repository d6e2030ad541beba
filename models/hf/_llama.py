"""Llama-family tensors <-> the parameters of `models.Llama`.

``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``
share one key layout (``model.layers.<i>.self_attn.q_proj.weight``, ...). Qwen2 adds
biases to ``q_proj``/``k_proj``/``v_proj`` (``(heads * head_dim,)`` -> our ``(heads,
head_dim)`` biases, config ``qkv_bias``); Qwen3 adds ``q_norm``/``k_norm`` weights of shape
``(head_dim,)`` (our ``query_norm``/``key_norm`` scales, config ``qk_norm``).

Llama stores ``torch.nn.Linear`` weights ``(out, in)``; ours are ``(in, out)``, with the
attention projections split per head: ``q_proj`` ``(heads * head_dim, embed)`` becomes the
query kernel ``(embed, heads, head_dim)``, ``k_proj``/``v_proj`` the ``(embed, kv_heads,
head_dim)`` kernels (grouped-query attention when ``kv_heads < heads``) and ``o_proj`` the
``(heads, head_dim, embed)`` output kernel.

Rotary embeddings need no permutation here. Meta's original weights rotate interleaved
feature pairs ``(2i, 2i+1)``; Hugging Face's conversion script permutes the rows of
``q_proj``/``k_proj`` once so that its ``rotate_half`` pairs feature ``i`` with ``i + D/2``
instead. `models._attention.apply_rotary` uses that same half-split pairing with the same
frequencies (``theta ** (-2i / D)``), so Hugging Face rows map onto our heads unchanged.

With ``tie_word_embeddings`` the checkpoint has only ``model.embed_tokens.weight``; it fills
both our token table and our (always separate) ``lm_head``, which is its transpose.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import einops
import numpy as np

from ..configs import ModelConfig
from ._layout import Rule, rearranged, same, transposed

IGNORED = re.compile(r"^(lm_head\.weight|.*\.rotary_emb\.inv_freq)$")
"""Keys a Llama checkpoint may hold that carry no parameter (a tied head, rotary buffers)."""


def canonical_key(key: str) -> str:
    """Llama keys are already canonical."""
    return key


# torch's ``(out, in)`` projection weights (and Qwen2's biases) <-> our per-head parameters.
_QKV_KERNEL = "(heads head_dim) embed -> embed heads head_dim"
_QKV_BIAS = "(heads head_dim) -> heads head_dim"
_OUT_KERNEL = "embed (heads head_dim) -> heads head_dim embed"


def _attention(config: ModelConfig, i: int) -> list[Rule]:
    e, h, k, d = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
    assert k is not None and d is not None
    p, b = f"model.layers.{i}.self_attn", (f"blocks_{i}", "attn")
    out = [
        rearranged(f"{p}.q_proj.weight", (h * d, e), (*b, "query", "kernel"), _QKV_KERNEL, heads=h),
        rearranged(f"{p}.k_proj.weight", (k * d, e), (*b, "key", "kernel"), _QKV_KERNEL, heads=k),
        rearranged(f"{p}.v_proj.weight", (k * d, e), (*b, "value", "kernel"), _QKV_KERNEL, heads=k),
    ]
    if config.qkv_bias:
        out += [
            rearranged(f"{p}.q_proj.bias", (h * d,), (*b, "query", "bias"), _QKV_BIAS, heads=h),
            rearranged(f"{p}.k_proj.bias", (k * d,), (*b, "key", "bias"), _QKV_BIAS, heads=k),
            rearranged(f"{p}.v_proj.bias", (k * d,), (*b, "value", "bias"), _QKV_BIAS, heads=k),
        ]
    if config.qk_norm:
        out += [
            same(f"{p}.q_norm.weight", (d,), (*b, "query_norm", "scale")),
            same(f"{p}.k_norm.weight", (d,), (*b, "key_norm", "scale")),
        ]
    o_proj = f"{p}.o_proj.weight"
    return [*out, rearranged(o_proj, (e, h * d), (*b, "out", "kernel"), _OUT_KERNEL, heads=h)]


def _block(config: ModelConfig, i: int) -> list[Rule]:
    e, m = config.embed_dim, config.mlp_dim
    p, b = f"model.layers.{i}", f"blocks_{i}"
    return [
        same(f"{p}.input_layernorm.weight", (e,), (b, "attn_norm", "scale")),
        *_attention(config, i),
        same(f"{p}.post_attention_layernorm.weight", (e,), (b, "mlp_norm", "scale")),
        transposed(f"{p}.mlp.gate_proj.weight", (m, e), (b, "mlp", "gate", "kernel")),
        transposed(f"{p}.mlp.up_proj.weight", (m, e), (b, "mlp", "up", "kernel")),
        transposed(f"{p}.mlp.down_proj.weight", (e, m), (b, "mlp", "down", "kernel")),
    ]


def _tied_embedding(vocab: int, embed: int) -> Rule:
    def both(xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        head = einops.rearrange(xs[0], "vocab embed -> embed vocab")
        return [xs[0], np.ascontiguousarray(head)]

    def table(xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [xs[0]]

    ours = (("stem", "embed", "embedding"), ("head", "lm_head", "kernel"))
    return Rule(("model.embed_tokens.weight",), ((vocab, embed),), ours, both, table)


def rules(config: ModelConfig, tied: bool) -> list[Rule]:
    """Every tensor of a Llama-family checkpoint for `config`, in stage order."""
    v, e = config.vocab_size, config.embed_dim
    if tied:
        out = [_tied_embedding(v, e)]
    else:
        out = [same("model.embed_tokens.weight", (v, e), ("stem", "embed", "embedding"))]
    for i in range(config.num_layers):
        out += _block(config, i)
    out.append(same("model.norm.weight", (e,), ("head", "final_norm", "scale")))
    if not tied:
        out.append(transposed("lm_head.weight", (v, e), ("head", "lm_head", "kernel")))
    return out
