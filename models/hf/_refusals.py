"""Why a Hugging Face architecture is refused: the fields and values our models lack.

`models.hf` reads architectures by name (`models.hf._config.ARCHITECTURES`). For any other
one, `unsupported_features` lists what its ``config.json`` asks for that the reference
models do not compute -- a mixture of experts, logit soft-capping, a GELU-gated MLP, a
partial rotary embedding, ... -- each as the field, its value and what we implement
instead, plus what some families change without a field of their own (Gemma scales its
embeddings and offsets its norm scales). When nothing specific is found it lists the
fields a Llama-style config needs that this one lacks, so the message always says more
than the architecture's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_NEEDED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)
"""The fields a Llama-family ``config.json`` must have."""


def _set(value: Any) -> bool:
    return value not in (None, False, 0, [], {})


def _experts(hf: dict[str, Any]) -> list[str]:
    keys = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
    return [
        f"`{k}`={hf[k]!r} (a mixture of experts; the reference MLP is one dense SwiGLU)"
        for k in keys
        if _set(hf.get(k))
    ]


def _activation(hf: dict[str, Any]) -> list[str]:
    out = []
    if _set(hf.get("hidden_activation")):
        out.append(
            f"`hidden_activation`={hf['hidden_activation']!r} (a GELU-gated MLP; the "
            "reference Llama's MLP is SwiGLU, `hidden_act`='silu')"
        )
    act = hf.get("hidden_act")
    if act is not None and act != "silu" and "hidden_activation" not in hf:
        out.append(f"`hidden_act`={act!r} (the reference Llama's MLP is SwiGLU, 'silu')")
    return out


def _attention(hf: dict[str, Any]) -> list[str]:
    checks: dict[str, str] = {
        "attn_logit_softcapping": "attention logits soft-capped with tanh",
        "final_logit_softcapping": "output logits soft-capped with tanh",
        "query_pre_attn_scalar": "queries scaled by this instead of 1/sqrt(`head_dim`)",
        "use_parallel_residual": "attention and MLP in parallel on one residual",
        "parallel_attn": "attention and MLP in parallel on one residual",
        "attention_bias": "biases on every attention projection, the output one included",
        "sliding_window_pattern": "sliding-window layers alternating with global ones",
    }
    out = [f"`{k}`={hf[k]!r} ({why})" for k, why in checks.items() if _set(hf.get(k))]
    for key in ("partial_rotary_factor", "rotary_pct"):
        if hf.get(key) not in (None, 1, 1.0):
            out.append(f"`{key}`={hf[key]!r} (a rotary embedding on part of each head)")
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        out.append(f"`layer_types` with {sliding[0]!r} layers (only full attention here)")
    return out


def _unfielded(hf: dict[str, Any]) -> list[str]:
    """What a family changes without a config field saying so."""
    if str(hf.get("model_type", "")).startswith("gemma"):
        return [
            "token embeddings multiplied by sqrt(`hidden_size`)",
            "RMSNorm scales stored as offsets from 1 (the norm multiplies by 1 + weight)",
        ]
    return []


_CHECKS: tuple[Callable[[dict[str, Any]], list[str]], ...] = (
    _experts,
    _activation,
    _attention,
    _unfielded,
)


def unsupported_features(hf: dict[str, Any]) -> list[str]:
    """Sentences naming what config `hf` asks for that the reference models lack.

    Example:
        >>> unsupported_features({"model_type": "mixtral", "num_local_experts": 8,
        ...                       "hidden_act": "silu"})
        ['`num_local_experts`=8 (a mixture of experts; the reference MLP is one dense SwiGLU)']
    """
    found = [reason for check in _CHECKS for reason in check(hf)]
    if found:
        return found
    missing = [f"`{k}`" for k in _NEEDED if k not in hf]
    if missing:
        return [f"no {', '.join(missing)} (the fields a Llama-style config.json has)"]
    return [
        "nothing this check recognises, but its computation is unverified (only the "
        "architectures by name are compared against transformers)"
    ]
