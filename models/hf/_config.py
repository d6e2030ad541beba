"""``config.json`` of a Hugging Face model folder <-> `ModelConfig`.

`read_config` turns a GPT-2 (``GPT2LMHeadModel``) or Llama (``LlamaForCausalLM``) config
into our `ModelConfig` plus whether the output head is tied to the token table (GPT-2
always is; Llama says so in ``tie_word_embeddings``). Every setting that changes the
computation is checked against what `models.GPT`/`models.Llama` implement, so a checkpoint
that would compute something else is refused instead of loading into wrong logits.
`hf_config` writes the fields back in the same format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from multimesh_flax import errors

from ..configs import Family, ModelConfig

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
ARCHITECTURES = {GPT2: Family.GPT, LLAMA: Family.LLAMA}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or a `PretrainedConfigError` naming the file."""
    if not path.is_file():
        raise errors.PretrainedConfigError(
            f"Expected a Hugging Face model folder with `{path.name}`, but {str(path)!r} does "
            "not exist. Point at the folder that `save_pretrained` wrote."
        )
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise errors.PretrainedConfigError(
            f"{str(path)!r} is not valid JSON ({error}). Re-download or re-save the model."
        ) from None
    if not isinstance(value, dict):
        raise errors.PretrainedConfigError(
            f"Expected a JSON object in {str(path)!r}, got {type(value).__name__}."
        )
    return value


def _field(hf: dict[str, Any], name: str, path: Path, default: Any = ...) -> Any:
    if name in hf and hf[name] is not None:
        return hf[name]
    if default is not ...:
        return default
    raise errors.PretrainedConfigError(
        f"{str(path)!r} has no `{name}`, which the model needs. Add it, or re-save the model "
        "with `save_pretrained`."
    )


def _require(hf: dict[str, Any], name: str, allowed: tuple[Any, ...], path: Path) -> None:
    value = hf.get(name, allowed[0])
    if value not in allowed:
        raise errors.UnsupportedArchitectureError(
            f"{str(path)!r} sets `{name}`={value!r}; the reference models implement only "
            f"{' or '.join(repr(a) for a in allowed)}. Use a checkpoint without it, or extend "
            "`models.gpt`/`models.llama`."
        )


def architecture(hf: dict[str, Any], path: Path) -> str:
    """The one supported name in ``architectures`` (or derived from ``model_type``)."""
    by_type = {"gpt2": [GPT2], "llama": [LLAMA]}
    names = hf.get("architectures") or by_type.get(str(hf.get("model_type")), [])
    known = [n for n in names if n in ARCHITECTURES]
    if not known:
        raise errors.UnsupportedArchitectureError(
            f"{str(path)!r} describes architectures={names!r} "
            f"(model_type={hf.get('model_type')!r}); `models.hf` reads only "
            f"{' and '.join(ARCHITECTURES)}. Convert the model to one of those, or extend "
            "`models.hf`."
        )
    return known[0]


def stored_dtype(hf: dict[str, Any]) -> Any:
    """The parameter dtype ``config.json`` declares (``dtype``/``torch_dtype``), if known."""
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name), jnp.float32)


def _gpt2(hf: dict[str, Any], path: Path, dtype: Any) -> ModelConfig:
    _require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"), path)
    _require(hf, "scale_attn_weights", (True,), path)
    _require(hf, "scale_attn_by_inverse_layer_idx", (False,), path)
    _require(hf, "add_cross_attention", (False,), path)
    embed = _field(hf, "n_embd", path)
    return ModelConfig(
        Family.GPT,
        vocab_size=_field(hf, "vocab_size", path),
        num_layers=_field(hf, "n_layer", path),
        embed_dim=embed,
        num_heads=_field(hf, "n_head", path),
        mlp_dim=_field(hf, "n_inner", path, 4 * embed),
        max_len=_field(hf, "n_positions", path),
        norm_eps=float(_field(hf, "layer_norm_epsilon", path, 1e-5)),
        dtype=dtype,
        param_dtype=dtype,
    )


def _rope_theta(hf: dict[str, Any], path: Path) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise errors.UnsupportedArchitectureError(
            f"{str(path)!r} sets rope_type={kind!r}; the reference Llama implements only the "
            "'default' rotary embedding (no rope scaling). Use a checkpoint without it."
        )
    return float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def _llama(hf: dict[str, Any], path: Path, dtype: Any) -> ModelConfig:
    _require(hf, "hidden_act", ("silu",), path)
    _require(hf, "attention_bias", (False,), path)
    _require(hf, "mlp_bias", (False,), path)
    heads = _field(hf, "num_attention_heads", path)
    embed = _field(hf, "hidden_size", path)
    return ModelConfig(
        Family.LLAMA,
        vocab_size=_field(hf, "vocab_size", path),
        num_layers=_field(hf, "num_hidden_layers", path),
        embed_dim=embed,
        num_heads=heads,
        num_kv_heads=_field(hf, "num_key_value_heads", path, heads),
        head_dim=_field(hf, "head_dim", path, embed // heads),
        mlp_dim=_field(hf, "intermediate_size", path),
        max_len=_field(hf, "max_position_embeddings", path),
        norm_eps=float(_field(hf, "rms_norm_eps", path, 1e-6)),
        rope_theta=_rope_theta(hf, path),
        dtype=dtype,
        param_dtype=dtype,
    )


def read_config(folder: Path, dtype: Any) -> tuple[ModelConfig, bool]:
    """``(config, tied)`` from ``folder/config.json``; `dtype` sets the config's dtypes."""
    path = folder / "config.json"
    hf = read_json(path)
    arch = architecture(hf, path)
    try:
        if arch == GPT2:
            return _gpt2(hf, path, dtype), True
        return _llama(hf, path, dtype), bool(hf.get("tie_word_embeddings", False))
    except errors.ModelConfigError as error:
        raise errors.PretrainedConfigError(
            f"{str(path)!r} describes an invalid model: {error}"
        ) from None


def dtype_name(dtype: Any) -> str:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` for a numpy/JAX dtype."""
    return np.dtype(dtype).name


def hf_config(config: ModelConfig, tied: bool, dtype: Any) -> dict[str, Any]:
    """The ``config.json`` of `config` in Hugging Face's format."""
    common = {"vocab_size": config.vocab_size, "dtype": dtype_name(dtype)}
    if config.family is Family.GPT:
        return {
            "architectures": [GPT2],
            "model_type": "gpt2",
            **common,
            "n_embd": config.embed_dim,
            "n_layer": config.num_layers,
            "n_head": config.num_heads,
            "n_inner": config.mlp_dim,
            "n_positions": config.max_len,
            "layer_norm_epsilon": config.norm_eps,
            "activation_function": "gelu_new",
            "tie_word_embeddings": True,
        }
    return {
        "architectures": [LLAMA],
        "model_type": "llama",
        **common,
        "hidden_size": config.embed_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.mlp_dim,
        "max_position_embeddings": config.max_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
    }
