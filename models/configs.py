"""Model configuration: one frozen dataclass for both families, plus named presets.

`ModelConfig` describes a decoder-only transformer. Its `family` field (a `Family`) picks the
architecture: `Family.GPT` (see `models.gpt`) or `Family.LLAMA` (see `models.llama`). Named
presets live in `PRESETS`, and `get_config` looks one up by name, optionally overriding fields.

Presets:

* ``gpt-tiny`` and ``llama-tiny``: two layers of width 64 over the padded byte vocabulary of
  `models.data.ByteTokenizer` (264 ids). A training step takes milliseconds on a CPU.
* ``gpt-small``: GPT-2 small (124M parameters): 12 layers, width 768, 12 heads, context 1024.
  Its vocabulary is GPT-2's BPE vocabulary (50257 ids) padded up to a multiple of 64, i.e.
  50304. No BPE tokenizer ships here; byte-level ids (< 264) fit in that table, so the preset
  also trains on byte data, or use ``get_config("gpt-small", vocab_size=264)``.
* ``llama-1b``: the shape of Llama 3.2 1B (16 layers, width 2048, 32 query heads sharing 8
  key/value heads, SwiGLU width 8192, rotary base 500000) with Llama 2's 32000-id vocabulary
  and an untied output head: about 1.1B parameters. Meant for GPUs; computes in bfloat16.

The Llama family also covers the variants that `models.hf` reads from Hugging Face
checkpoints, each switched on by a field that is off in every preset: Llama 3.1's rope
scaling (`rope_scaling`, a `RopeScaling`), Qwen2's biases on the query/key/value projections
(`qkv_bias`), Qwen3's per-head RMSNorm of queries and keys (`qk_norm`) and Mistral's
attention window (`sliding_window`).
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from multimesh_flax import errors

__all__ = ["PRESETS", "Family", "ModelConfig", "RopeScaling", "get_config"]


class Family(enum.Enum):
    """Which architecture a `ModelConfig` describes."""

    GPT = "gpt"
    LLAMA = "llama"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rope scaling: stretches the long rotary wavelengths for a longer context.

    Each rotary frequency ``f`` (wavelength ``w = 2 pi / f``) is rescaled against the context
    length the model was first pretrained with, ``L = original_max_len``: a frequency whose
    wavelength is shorter than ``L / high_freq_factor`` is kept, one longer than
    ``L / low_freq_factor`` is divided by `factor`, and the ones in between are blended,
    ``(1 - s) * f / factor + s * f`` with ``s = (L / w - low_freq_factor) /
    (high_freq_factor - low_freq_factor)``. This is ``rope_type: "llama3"`` in a Hugging
    Face ``config.json``.

    Attributes:
        factor: How much the longest wavelengths are stretched (8 in Llama 3.1), at least 1.
        low_freq_factor: ``L / low_freq_factor`` is the wavelength above which frequencies
            are divided by `factor`.
        high_freq_factor: ``L / high_freq_factor`` is the wavelength below which frequencies
            are kept; larger than `low_freq_factor`.
        original_max_len: ``L``, the pretraining context (``original_max_position_embeddings``).

    Example:
        >>> from models import get_config
        >>> from models.configs import RopeScaling
        >>> scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        ...                       original_max_len=8192)
        >>> get_config("llama-tiny", rope_scaling=scaling).rope_scaling.factor
        8.0
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self):
        if not isinstance(self.factor, (int, float)) or not self.factor >= 1.0:
            raise errors.ModelConfigError(
                f"`RopeScaling.factor` must be a number >= 1, got {self.factor!r}."
            )
        low, high = self.low_freq_factor, self.high_freq_factor
        if not isinstance(low, (int, float)) or not isinstance(high, (int, float)):
            raise errors.ModelConfigError(
                f"`low_freq_factor` and `high_freq_factor` must be numbers, got {low!r} and "
                f"{high!r}."
            )
        if not 0 < low < high:
            raise errors.ModelConfigError(
                f"Expected 0 < `low_freq_factor` < `high_freq_factor`, got {low!r} and {high!r} "
                "(Llama 3.1 uses 1 and 4)."
            )
        if not isinstance(self.original_max_len, int) or self.original_max_len <= 0:
            raise errors.ModelConfigError(
                f"`original_max_len` must be a positive int, got {self.original_max_len!r}."
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer.

    Attributes:
        family: The architecture, `Family.GPT` or `Family.LLAMA`.
        vocab_size: Number of rows in the token embedding (and columns of the logits).
        num_layers: Number of transformer blocks.
        embed_dim: Width of the residual stream.
        num_heads: Number of query heads.
        num_kv_heads: Number of key/value heads; must divide `num_heads`. ``None`` means
            `num_heads` (plain multi-head attention); fewer gives grouped-query attention.
        head_dim: Width of one head. ``None`` means ``embed_dim // num_heads``.
        mlp_dim: Hidden width of the feed-forward network.
        max_len: Longest sequence the model accepts (GPT's learned position table has this
            many rows; `models.generate.generate` checks it for both families).
        dropout_rate: Dropout on embeddings, attention probabilities and residual branches,
            active only when a model is called with ``deterministic=False``.
        norm_eps: Epsilon of LayerNorm (GPT) or RMSNorm (Llama).
        rope_theta: Base of the rotary position frequencies (Llama only).
        rope_scaling: Llama 3.1's rescaling of those frequencies (a `RopeScaling`, or a
            mapping of its fields); ``None``: none (Llama only).
        qkv_bias: Whether the query, key and value projections have biases (Qwen2); the
            output projection never has one (Llama only).
        qk_norm: Whether queries and keys pass through an RMSNorm over ``head_dim``, one
            scale shared by all heads, before the rotary embedding (Qwen3; Llama only).
        sliding_window: Mistral's attention window: each token attends to at most this many
            latest positions. The models attend to every earlier position, which is the
            same computation for sequences no longer than the window, so a longer sequence
            raises `SequenceLengthError`. ``None``: no window (Llama only).
        dtype: Dtype of the computation (activations).
        param_dtype: Dtype in which parameters are stored.

    `num_kv_heads` and `head_dim` are resolved when the config is built, so
    ``dataclasses.replace(config, num_heads=8)`` keeps the old resolved values; pass them
    explicitly, or use ``get_config(name, num_heads=8)``, which re-derives them.

    Example:
        >>> from models import Family, ModelConfig
        >>> config = ModelConfig(Family.LLAMA, vocab_size=264, num_layers=2, embed_dim=64,
        ...                      num_heads=4, num_kv_heads=2, mlp_dim=176, max_len=128)
        >>> config.head_dim, config.num_kv_heads
        (16, 2)
    """

    family: Family
    vocab_size: int
    num_layers: int
    embed_dim: int
    num_heads: int
    mlp_dim: int
    max_len: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    dropout_rate: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        if not isinstance(self.family, Family):
            object.__setattr__(self, "family", _to_family(self.family))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", _to_rope_scaling(self.rope_scaling))
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", _default_head_dim(self))
        _check_config(self)


def _to_family(value: Any) -> Family:
    try:
        return Family(value)
    except ValueError:
        valid = [f.value for f in Family]
        raise errors.ModelConfigError(f"`family` must be one of {valid}, got {value!r}.") from None


def _to_rope_scaling(value: Mapping[str, Any]) -> RopeScaling:
    fields = [f.name for f in dataclasses.fields(RopeScaling)]
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise errors.ModelConfigError(
            f"Unknown `rope_scaling` field {unknown[0]!r}; valid fields: {', '.join(fields)}."
        )
    return RopeScaling(**value)


def _default_head_dim(config: ModelConfig) -> int:
    if config.num_heads <= 0 or config.embed_dim % config.num_heads:
        raise errors.ModelConfigError(
            f"`embed_dim` ({config.embed_dim}) must be a positive multiple of `num_heads` "
            f"({config.num_heads}) unless `head_dim` is given explicitly."
        )
    return config.embed_dim // config.num_heads


def _check_config(config: ModelConfig) -> None:
    sizes = ("vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads")
    sizes += ("head_dim", "mlp_dim", "max_len")
    for field in sizes:
        value = getattr(config, field)
        if not isinstance(value, int) or value <= 0:
            raise errors.ModelConfigError(f"`{field}` must be a positive int, got {value!r}.")
    assert config.num_kv_heads is not None  # Filled in by __post_init__.
    if config.num_heads % config.num_kv_heads:
        raise errors.ModelConfigError(
            f"`num_kv_heads` ({config.num_kv_heads}) must divide `num_heads` "
            f"({config.num_heads}); each key/value head serves a whole group of query heads."
        )
    if config.head_dim is not None and config.head_dim % 2 and config.family is Family.LLAMA:
        raise errors.ModelConfigError(
            f"Rotary embeddings need an even `head_dim`, got {config.head_dim}."
        )
    if not 0.0 <= config.dropout_rate < 1.0:
        raise errors.ModelConfigError(
            f"`dropout_rate` must be in [0, 1), got {config.dropout_rate!r}."
        )
    _check_llama_features(config)


def _check_llama_features(config: ModelConfig) -> None:
    """The Llama-only fields: well-typed, and left at their defaults for GPT."""
    if config.rope_scaling is not None and not isinstance(config.rope_scaling, RopeScaling):
        raise errors.ModelConfigError(
            f"`rope_scaling` must be a RopeScaling, a mapping of its fields or None, got "
            f"{config.rope_scaling!r}."
        )
    window = config.sliding_window
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise errors.ModelConfigError(
            f"`sliding_window` must be a positive int or None, got {window!r}."
        )
    if config.family is Family.LLAMA:
        return
    defaults = {"rope_scaling": None, "qkv_bias": False, "qk_norm": False}
    defaults["sliding_window"] = None
    for field, default in defaults.items():
        if getattr(config, field) != default:
            raise errors.ModelConfigError(
                f"`{field}`={getattr(config, field)!r} is a Llama-family feature; the GPT "
                f"model does not implement it. Leave it at {default!r}, or use "
                "`family=Family.LLAMA`."
            )


_PRESET_ARGS: dict[str, dict[str, Any]] = {
    "gpt-tiny": dict(
        family=Family.GPT,
        vocab_size=264,
        num_layers=2,
        embed_dim=64,
        num_heads=4,
        mlp_dim=256,
        max_len=128,
    ),
    "gpt-small": dict(
        family=Family.GPT,
        vocab_size=50_304,
        num_layers=12,
        embed_dim=768,
        num_heads=12,
        mlp_dim=3072,
        max_len=1024,
        dropout_rate=0.1,
        dtype=jnp.bfloat16,
    ),
    "llama-tiny": dict(
        family=Family.LLAMA,
        vocab_size=264,
        num_layers=2,
        embed_dim=64,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=176,
        max_len=128,
    ),
    "llama-1b": dict(
        family=Family.LLAMA,
        vocab_size=32_000,
        num_layers=16,
        embed_dim=2048,
        num_heads=32,
        num_kv_heads=8,
        mlp_dim=8192,
        max_len=2048,
        rope_theta=500_000.0,
        dtype=jnp.bfloat16,
    ),
}

PRESETS: Mapping[str, ModelConfig] = types.MappingProxyType(
    {name: ModelConfig(**args) for name, args in _PRESET_ARGS.items()}
)
"""Named configurations, read-only. See the module docstring for what each one is."""


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """Returns the preset called `name`, with any fields in `overrides` replaced.

    Args:
        name: A key of `PRESETS`, e.g. ``"gpt-tiny"``.
        **overrides: `ModelConfig` fields to change, e.g. ``vocab_size=264``. Derived
            fields (`num_kv_heads`, `head_dim`) are re-derived unless the preset sets them.

    Returns:
        The (validated) configuration.

    Raises:
        ModelConfigError: If `name` is not a preset, an override names no `ModelConfig`
            field, or an override makes the config invalid (a `ValueError`).

    Example:
        >>> from models import get_config
        >>> get_config("gpt-tiny").num_layers
        2
        >>> get_config("gpt-small", vocab_size=264).vocab_size
        264
        >>> get_config("gpt-huge")
        Traceback (most recent call last):
        ...
        multimesh_flax.errors.ModelConfigError: Unknown preset `name`='gpt-huge'. Valid names: ...
    """
    if name not in PRESETS:
        raise errors.ModelConfigError(
            f"Unknown preset `name`={name!r}. Valid names: {', '.join(PRESETS)}. "
            "Build a `ModelConfig` directly for anything else."
        )
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise errors.ModelConfigError(
            f"Unknown `ModelConfig` field {unknown[0]!r} in the overrides of {name!r}. Valid "
            f"fields: {', '.join(fields)}."
        )
    return ModelConfig(**{**_PRESET_ARGS[name], **overrides})
