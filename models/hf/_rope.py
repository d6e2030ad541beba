"""The rotary embedding settings of a Hugging Face ``config.json`` <-> ``rope_theta`` and
`models.configs.RopeScaling`.

transformers spells them two ways. Configs written before transformers v5 have a top-level
``rope_theta`` and, for a scaled rope, a ``rope_scaling`` mapping (``{"rope_type": "llama3",
"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
"original_max_position_embeddings": 8192}``; older still: ``"type"`` for ``"rope_type"``);
v5 writes one ``rope_parameters`` mapping that also holds ``rope_theta``. `read_rope`
accepts both (and refuses both at once when they disagree). The reference Llama implements
the ``"default"`` rope and Llama 3.1's ``"llama3"`` scaling; every other ``rope_type``
(``"linear"``, ``"dynamic"``, ``"yarn"``, ``"longrope"``, ...), a rotary embedding on part
of each head (``partial_rotary_factor``) and a different rope per layer type are refused,
naming the field. `hf_rope` writes both spellings, so v4 and v5 readers agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multimesh_flax import errors

from ..configs import ModelConfig, RopeScaling

SUPPORTED = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
_SCALING_KEYS = ("rope_type", *_LLAMA3_KEYS, "original_max_position_embeddings")


def _kind(rope: dict[str, Any]) -> Any:
    return rope.get("rope_type", rope.get("type", "default"))


def _scaling_part(rope: dict[str, Any]) -> dict[str, Any]:
    """The settings of `rope` that change the frequencies besides ``rope_theta``."""
    out = {k: rope[k] for k in _SCALING_KEYS[1:] if k in rope}
    return {"rope_type": _kind(rope), **out}


def _mapping(hf: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    value = hf.get(name) or {}
    if not isinstance(value, dict):
        raise errors.PretrainedConfigError(
            f"{str(path)!r} sets `{name}`={value!r}; expected a JSON object (or null). Fix "
            "config.json or re-save the model with `save_pretrained`."
        )
    nested = sorted(k for k, v in value.items() if isinstance(v, dict))
    if nested:
        raise errors.UnsupportedArchitectureError(
            f"{str(path)!r} sets a different rotary embedding per layer type (`{name}` keyed "
            f"by {nested!r}); the reference Llama uses one rope for every layer. Use a "
            "checkpoint with one rope setting."
        )
    return value


def _merged(hf: dict[str, Any], path: Path) -> tuple[str, dict[str, Any]]:
    """``(field name, settings)`` from ``rope_parameters`` and/or ``rope_scaling``."""
    params, scaling = _mapping(hf, "rope_parameters", path), _mapping(hf, "rope_scaling", path)
    if params and scaling and _scaling_part(params) != _scaling_part(scaling):
        raise errors.PretrainedConfigError(
            f"{str(path)!r} sets both `rope_parameters` ({_scaling_part(params)}) and "
            f"`rope_scaling` ({_scaling_part(scaling)}), and they disagree. Keep one of them "
            "(transformers v5 writes `rope_parameters`)."
        )
    name = "rope_scaling" if scaling and not params else "rope_parameters"
    return name, {**scaling, **params}


def _number(rope: dict[str, Any], key: str, name: str, path: Path) -> float:
    value = rope.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.PretrainedConfigError(
            f"{str(path)!r} sets `{name}.rope_type`='llama3' but `{name}.{key}` is {value!r}; "
            "Llama 3.1's rope scaling needs a number there. Fix config.json."
        )
    return value


def read_rope(hf: dict[str, Any], path: Path, max_len: int) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of a Llama-family ``config.json``.

    ``original_max_position_embeddings`` falls back, as in transformers, to the top-level
    field of that name and then to `max_len` (``max_position_embeddings``).
    """
    name, rope = _merged(hf, path)
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10_000.0)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise errors.UnsupportedArchitectureError(
            f"{str(path)!r} sets `partial_rotary_factor`={partial!r}; the reference Llama "
            "rotates every feature of each head (1.0). Use a checkpoint without it."
        )
    kind = _kind(rope)
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise errors.UnsupportedArchitectureError(
            f"{str(path)!r} sets `{name}.rope_type`={kind!r}; the reference Llama implements "
            f"only {' and '.join(repr(k) for k in SUPPORTED)} (Llama 3.1's scaling). Use a "
            "checkpoint without that rope scaling, or extend `models._attention`."
        )
    original = rope.get("original_max_position_embeddings")
    original = original or hf.get("original_max_position_embeddings") or max_len
    factors = {key: _number(rope, key, name, path) for key in _LLAMA3_KEYS}
    return theta, RopeScaling(**factors, original_max_len=original)


def hf_rope(config: ModelConfig) -> dict[str, Any]:
    """The rope fields of `config`'s ``config.json``, in both transformers spellings."""
    scaling = config.rope_scaling
    if scaling is None:
        settings: dict[str, Any] = {"rope_type": "default"}
    else:
        settings = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_len,
        }
    out: dict[str, Any] = {"rope_parameters": {**settings, "rope_theta": config.rope_theta}}
    out["rope_theta"] = config.rope_theta
    if scaling is not None:
        out["rope_scaling"] = settings
    return out
