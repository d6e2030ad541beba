"""GPT-2 (``GPT2LMHeadModel``) tensors <-> the parameters of `models.GPT`.

GPT-2 stores its projections as ``Conv1D`` weights of shape ``(in, out)`` -- already our
layout -- and fuses the query, key and value projections into one ``c_attn`` tensor of shape
``(embed, 3 * embed)``, which splits into our three ``(embed, heads, head_dim)`` kernels (its
bias into three ``(heads, head_dim)`` biases). The output head is tied to ``wte``, so the
checkpoint has no ``lm_head.weight`` (one that is present is ignored, as transformers does).

Keys are canonical with the ``transformer.`` prefix; checkpoints published before that
prefix existed (``h.0.attn.c_attn.weight``, ``wte.weight``) load too (`canonical_key`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import einops
import numpy as np

from ..configs import ModelConfig
from ._layout import Rule, rearranged, same

PREFIX = "transformer."
IGNORED = re.compile(r"^(lm_head\.weight|.*\.attn\.(masked_)?bias)$")
"""Keys a GPT-2 checkpoint may hold that carry no parameter (the tied head, causal masks)."""

_OUT_KERNEL = "(heads head_dim) embed -> heads head_dim embed"
"""``Conv1D`` weights are already ``(in, out)``: ``c_proj`` only splits its input into heads."""


def canonical_key(key: str) -> str:
    """`key` with the ``transformer.`` prefix that older checkpoints leave out."""
    if key.startswith(PREFIX) or key.startswith("lm_head."):
        return key
    return PREFIX + key


def _fused_qkv(prefix: str, config: ModelConfig, i: int, part: str) -> Rule:
    e, h, d = config.embed_dim, config.num_heads, config.head_dim
    assert d is not None
    ours = tuple((f"blocks_{i}", "attn", n, part) for n in ("query", "key", "value"))
    # The kernel has a leading input axis; the bias has none.
    in_axis, shape = ("embed ", (e, 3 * h * d)) if part == "kernel" else ("", (3 * h * d,))
    fused = f"{in_axis}(qkv heads head_dim)"
    split = f"qkv {in_axis}heads head_dim"

    def to_ours(xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        parts = einops.rearrange(xs[0], f"{fused} -> {split}", qkv=3, heads=h)
        return [np.ascontiguousarray(x) for x in parts]

    def to_hf(xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [einops.rearrange(list(xs), f"{split} -> {fused}")]

    hf_name = "weight" if part == "kernel" else "bias"
    return Rule((f"{prefix}.attn.c_attn.{hf_name}",), (shape,), ours, to_ours, to_hf)


def _norm(hf: str, e: int, ours: tuple[str, ...]) -> list[Rule]:
    return [same(f"{hf}.weight", (e,), (*ours, "scale")), same(f"{hf}.bias", (e,), (*ours, "bias"))]


def _block(config: ModelConfig, i: int) -> list[Rule]:
    e, m, h, d = config.embed_dim, config.mlp_dim, config.num_heads, config.head_dim
    assert d is not None
    p, b = f"{PREFIX}h.{i}", f"blocks_{i}"
    c_proj = f"{p}.attn.c_proj.weight"
    return [
        *_norm(f"{p}.ln_1", e, (b, "attn_norm")),
        _fused_qkv(p, config, i, "kernel"),
        _fused_qkv(p, config, i, "bias"),
        rearranged(c_proj, (h * d, e), (b, "attn", "out", "kernel"), _OUT_KERNEL, heads=h),
        same(f"{p}.attn.c_proj.bias", (e,), (b, "attn", "out", "bias")),
        *_norm(f"{p}.ln_2", e, (b, "mlp_norm")),
        same(f"{p}.mlp.c_fc.weight", (e, m), (b, "mlp", "fc", "kernel")),
        same(f"{p}.mlp.c_fc.bias", (m,), (b, "mlp", "fc", "bias")),
        same(f"{p}.mlp.c_proj.weight", (m, e), (b, "mlp", "proj", "kernel")),
        same(f"{p}.mlp.c_proj.bias", (e,), (b, "mlp", "proj", "bias")),
    ]


def rules(config: ModelConfig, tied: bool = True) -> list[Rule]:
    """Every tensor of a GPT-2 checkpoint for `config`, in stage order (`tied` is always)."""
    del tied
    e = config.embed_dim
    out = [
        same(f"{PREFIX}wte.weight", (config.vocab_size, e), ("stem", "embed", "embedding")),
        same(f"{PREFIX}wpe.weight", (config.max_len, e), ("stem", "pos_embed", "embedding")),
    ]
    for i in range(config.num_layers):
        out += _block(config, i)
    return out + _norm(f"{PREFIX}ln_f", e, ("head", "final_norm"))
