"""``config.json`` of a Hugging Face model folder <-> `ModelConfig`.

`read_config` turns a GPT-2 (``GPT2LMHeadModel``), Llama (``LlamaForCausalLM``), Mistral
(``MistralForCausalLM``), Qwen2 (``Qwen2ForCausalLM``) or Qwen3 (``Qwen3ForCausalLM``) config
into our `ModelConfig` plus whether the output head is tied to the token table (GPT-2
always is; the others say so in ``tie_word_embeddings``). The last four are all
`models.Llama`, with the variant fields of `ModelConfig`: Qwen2 sets ``qkv_bias``, Qwen3
``qk_norm`` (and usually a ``head_dim`` other than ``hidden_size / num_attention_heads``),
Mistral ``sliding_window``, and any of them may carry Llama 3.1's rope scaling
(`models.hf._rope`). Every setting that changes the computation is checked against what
`models.GPT`/`models.Llama` implement, so a checkpoint that would compute something else is
refused -- naming the field and its value (`models.hf._refusals` for whole architectures)
-- instead of loading into wrong logits. `hf_config` writes the fields back, under the
architecture whose computation the config describes (`export_architecture`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from multimesh_flax import errors

from ..configs import Family, ModelConfig
from . import _refusals, _rope

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
ARCHITECTURES = {
    GPT2: Family.GPT,
    LLAMA: Family.LLAMA,
    MISTRAL: Family.LLAMA,
    QWEN2: Family.LLAMA,
    QWEN3: Family.LLAMA,
}
_MODEL_TYPES = {"gpt2": GPT2, "llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3}

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
    model_type = hf.get("model_type")
    names = hf.get("architectures") or [_MODEL_TYPES.get(str(model_type), str(model_type))]
    known = [n for n in names if n in ARCHITECTURES]
    if not known:
        reasons = "; ".join(_refusals.unsupported_features(hf))
        raise errors.UnsupportedArchitectureError(
            f"{str(path)!r} describes architectures={names!r} (model_type={model_type!r}); "
            f"`models.hf` reads only {', '.join(ARCHITECTURES)}. What this config asks for "
            f"that those lack: {reasons}. Convert the model to one of those, or extend "
            "`models.hf` and the reference models."
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


def _head_dim(hf: dict[str, Any], arch: str, embed: int, heads: int, path: Path) -> int:
    # Qwen3Config defaults head_dim to 128; the others to hidden_size // num_attention_heads.
    return _field(hf, "head_dim", path, 128 if arch == QWEN3 else embed // heads)


def _sliding_window(hf: dict[str, Any], arch: str, path: Path) -> int | None:
    """Mistral's window (MistralConfig's default 4096 when absent, none when null)."""
    if arch == MISTRAL:
        return hf.get("sliding_window", 4096)
    if arch in (QWEN2, QWEN3):
        _require(hf, "use_sliding_window", (False,), path)
        sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
        if sliding:
            raise errors.UnsupportedArchitectureError(
                f"{str(path)!r} sets `layer_types` with {sliding[0]!r} layers; the reference "
                "Llama implements only 'full_attention' layers. Use a checkpoint without them."
            )
    return None


def _llama(hf: dict[str, Any], path: Path, dtype: Any, arch: str) -> ModelConfig:
    _require(hf, "hidden_act", ("silu",), path)
    _require(hf, "mlp_bias", (False,), path)
    if arch in (LLAMA, QWEN3):  # their `attention_bias` puts a bias on the output too
        _require(hf, "attention_bias", (False,), path)
    heads = _field(hf, "num_attention_heads", path)
    embed = _field(hf, "hidden_size", path)
    max_len = _field(hf, "max_position_embeddings", path)
    theta, scaling = _rope.read_rope(hf, path, max_len)
    return ModelConfig(
        Family.LLAMA,
        vocab_size=_field(hf, "vocab_size", path),
        num_layers=_field(hf, "num_hidden_layers", path),
        embed_dim=embed,
        num_heads=heads,
        num_kv_heads=_field(hf, "num_key_value_heads", path, heads),
        head_dim=_head_dim(hf, arch, embed, heads, path),
        mlp_dim=_field(hf, "intermediate_size", path),
        max_len=max_len,
        norm_eps=float(_field(hf, "rms_norm_eps", path, 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=arch == QWEN2,
        qk_norm=arch == QWEN3,
        sliding_window=_sliding_window(hf, arch, path),
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
        return _llama(hf, path, dtype, arch), bool(hf.get("tie_word_embeddings", False))
    except errors.ModelConfigError as error:
        raise errors.PretrainedConfigError(
            f"{str(path)!r} describes an invalid model: {error}"
        ) from None


def dtype_name(dtype: Any) -> str:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` for a numpy/JAX dtype."""
    return np.dtype(dtype).name


def export_architecture(config: ModelConfig) -> str:
    """The Hugging Face architecture that computes what `config` does.

    GPT is GPT-2. In the Llama family ``qk_norm`` is Qwen3, ``qkv_bias`` Qwen2, a
    ``sliding_window`` Mistral, anything else Llama (a Mistral without a window is a Llama,
    and is written as one).
    """
    if config.family is Family.GPT:
        return GPT2
    features = [f for f in ("qkv_bias", "qk_norm") if getattr(config, f)]
    if config.sliding_window is not None:
        features.append("sliding_window")
    if len(features) > 1:
        raise errors.UnsupportedArchitectureError(
            f"`config` combines {' and '.join(f'`{f}`' for f in features)}; no Hugging Face "
            f"architecture that `models.hf` writes ({', '.join(ARCHITECTURES)}) has both. "
            "Keep one of them to export."
        )
    if config.qk_norm:
        return QWEN3
    if config.qkv_bias:
        return QWEN2
    return LLAMA if config.sliding_window is None else MISTRAL


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
    arch = export_architecture(config)
    model_type = {v: k for k, v in _MODEL_TYPES.items()}[arch]
    return {
        "architectures": [arch],
        "model_type": model_type,
        **common,
        "hidden_size": config.embed_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.mlp_dim,
        "max_position_embeddings": config.max_len,
        "rms_norm_eps": config.norm_eps,
        **_rope.hf_rope(config),
        "hidden_act": "silu",
        **_ATTENTION_FIELDS[arch](config),
        "tie_word_embeddings": tied,
    }


_ATTENTION_FIELDS = {
    LLAMA: lambda c: {"attention_bias": False, "mlp_bias": False},
    MISTRAL: lambda c: {"sliding_window": c.sliding_window},
    QWEN2: lambda c: {"use_sliding_window": False, "sliding_window": None},
    QWEN3: lambda c: {"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
}
"""The attention fields of each architecture's ``config.json`` that a config decides."""
