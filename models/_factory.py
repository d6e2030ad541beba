"""`make_model`: builds the Flax module that a `ModelConfig` describes."""

from __future__ import annotations

from .configs import Family, ModelConfig, get_config
from .gpt import GPT
from .llama import Llama


def make_model(config: ModelConfig | str) -> GPT | Llama:
    """Returns the model for `config`: a `GPT` or a `Llama` depending on ``config.family``.

    Args:
        config: A `ModelConfig`, or the name of a preset (see `models.configs.get_config`).

    Returns:
        An unbound Flax module; call ``init``/``apply`` on it.

    Raises:
        ValueError: If `config` names no preset.
        TypeError: If `config` is neither a `ModelConfig` nor a string.

    Example:
        >>> from models import make_model
        >>> type(make_model("llama-tiny")).__name__
        'Llama'
    """
    if isinstance(config, str):
        config = get_config(config)
    if not isinstance(config, ModelConfig):
        raise TypeError(
            f"`config` must be a ModelConfig or a preset name, got {type(config).__name__}."
        )
    return GPT(config) if config.family is Family.GPT else Llama(config)
