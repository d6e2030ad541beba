"""`load` and `load_placed`: a Hugging Face model folder -> `ModelConfig` and parameters.

Both read ``config.json`` (`models.hf._config`), check every tensor's key, shape and
(floating) dtype against what the config implies before reading any data
(`models.hf._files`), then convert tensor by tensor, each checked to be finite as it is
read, with the family's rules (`models.hf._gpt2`, `models.hf._llama`). `load` returns
host NumPy arrays; `load_placed` hands each converted tensor straight to its stage's submesh
in the sharding `multimesh_flax.layers.get_placement` derives for the pipelined model, so
the host holds one tensor at a time and no device ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

import multimesh_flax as mm
from multimesh_flax import errors

from .. import pipeline
from .._factory import make_model
from ..configs import Family, ModelConfig
from . import _config, _files, _gpt2, _llama
from ._layout import Path as ParamPath
from ._layout import Rule, set_path

log = logging.getLogger(__name__)

_FAMILIES = {Family.GPT: _gpt2, Family.LLAMA: _llama}
_TABLE = ("stem", "embed", "embedding")
_HEAD = ("head", "lm_head", "kernel")


def family_module(config: ModelConfig) -> Any:
    """`models.hf._gpt2` or `models.hf._llama` for ``config.family``."""
    return _FAMILIES[config.family]


def _check_keys(files: _files.TensorFiles, rules: list[Rule], module: Any) -> None:
    expected = {key: shape for r in rules for key, shape in zip(r.hf, r.hf_shapes, strict=True)}
    for key, shape in expected.items():
        if key not in files.shapes:
            raise errors.PretrainedTensorError(
                f"Tensor {key!r} is missing from the checkpoint in {str(files.folder)!r}, but "
                "config.json implies it. Fix config.json (layer count, tied head) or copy the "
                "complete checkpoint."
            )
        if files.shapes[key] != shape:
            raise errors.PretrainedTensorError(
                f"Tensor {key!r} in {str(files.files[key])!r} has shape {files.shapes[key]}, "
                f"but config.json implies {shape}. Fix config.json or the checkpoint."
            )
        if files.dtypes[key] not in _files.FLOATING:
            raise errors.PretrainedTensorError(
                f"Tensor {key!r} in {str(files.files[key])!r} has dtype {files.dtypes[key]}, "
                f"but model weights are floating point ({', '.join(sorted(_files.FLOATING))}); "
                "loading would turn integers into weights silently. Re-save the checkpoint "
                "with floating-point weights (a quantized checkpoint must be dequantized first)."
            )
    extra = sorted(k for k in files.shapes if k not in expected and not module.IGNORED.match(k))
    if extra:
        raise errors.PretrainedTensorError(
            f"Tensor {extra[0]!r} in {str(files.files[extra[0]])!r} is not part of the model "
            f"config.json describes ({len(extra)} such tensors). Fix config.json (layer "
            "count, head tying) or remove the tensors."
        )


def _padded_vocab(config: ModelConfig, vocab_multiple: int | None) -> int:
    if vocab_multiple is None:
        return config.vocab_size
    if not isinstance(vocab_multiple, int) or vocab_multiple < 1:
        raise errors.VocabularySplitError(
            f"Expected `vocab_multiple` to be a positive int, got {vocab_multiple!r}."
        )
    return -(-config.vocab_size // vocab_multiple) * vocab_multiple


def _pad(path: ParamPath, array: np.ndarray, vocab: int) -> np.ndarray:
    axis = {_TABLE: 0, _HEAD: 1}.get(path)
    if axis is None or array.shape[axis] == vocab:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, vocab - array.shape[axis])
    return np.pad(array, widths)


def _stored_dtype(files: _files.TensorFiles, rules: list[Rule]) -> Any:
    return _config.stored_dtype({"dtype": files.dtypes[rules[0].hf[0]]})


def _read(
    folder: Path,
    split: tuple[int | None, Sequence[int] | None],
    dtype: Any,
    vocab_multiple: int | None,
    put: Callable[[ModelConfig, ParamPath, np.ndarray], Any],
) -> tuple[ModelConfig, dict]:
    """The shared walk: config, checks, then ``put(config, path, array)`` per parameter."""
    if not folder.is_dir():
        raise errors.PretrainedConfigError(
            f"Expected a Hugging Face model folder, got {str(folder)!r}, which is not a "
            "directory. Pass the folder that holds config.json and the safetensors files."
        )
    config, tied = _config.read_config(folder, dtype or np.float32)
    pipeline.get_layers_per_stage(config.num_layers, *split)
    module = family_module(config)
    rules = module.rules(config, tied)
    vocab = _padded_vocab(config, vocab_multiple)
    with _files.TensorFiles(folder, module.canonical_key) as files:
        _check_keys(files, rules, module)
        if dtype is None:
            stored = _stored_dtype(files, rules)
            config = dataclasses.replace(config, dtype=stored, param_dtype=stored)
        config = dataclasses.replace(config, vocab_size=vocab)
        params: dict = {}
        for rule in rules:
            arrays = rule.to_ours([files.read(k, dtype) for k in rule.hf])
            for path, array in zip(rule.ours, arrays, strict=True):
                set_path(params, path, put(config, path, _pad(path, array, vocab)))
    log.info("loaded %s (%s, %d layers)", folder, config.family.value, config.num_layers)
    return config, params


def load(
    path: str | os.PathLike,
    *,
    stages: int | None = None,
    layers_per_stage: Sequence[int] | None = None,
    dtype: Any = None,
    vocab_multiple: int | None = None,
) -> tuple[ModelConfig, dict]:
    """Reads a Hugging Face GPT-2, Llama, Mistral, Qwen2 or Qwen3 folder into our config
    and parameter tree.

    Mistral's ``sliding_window`` is kept in the config; the model then refuses sequences
    longer than the window (`SequenceLengthError`) rather than attend past it.

    Args:
        path: A folder with ``config.json`` and ``model.safetensors`` (or sharded files with
            ``model.safetensors.index.json``), as ``save_pretrained`` writes it.
        stages: The pipeline stage count the model will run with, if any; checked to
            divide the layers (the parameter tree itself is the same for every split).
        layers_per_stage: Or the blocks of every stage, for an uneven split; checked to be
            a split of the layers (`models.pipeline.get_layers_per_stage`).
        dtype: Cast every tensor to this dtype (and set the config's dtypes to it); ``None``
            keeps the stored dtype (bfloat16 and float16 checkpoints load as stored).
        vocab_multiple: Pad the vocabulary with zero rows up to a multiple of this, so it
            splits over a ``model`` axis of that size.

    Returns:
        ``(config, params)``: a `ModelConfig` and the ``params`` of ``make_model(config)``
        as host NumPy arrays.

    Raises:
        PretrainedConfigError: No folder, no or unreadable ``config.json``, no weights.
        UnsupportedArchitectureError: Another architecture (the message lists what it
            asks for that our models lack), or a feature our models lack (a rope type other
            than ``"llama3"``, Llama's ``attention_bias``, Qwen's sliding-window layers, ...).
        PretrainedTensorError: A missing, extra, wrongly shaped or unreadable tensor, one
            with a non-floating dtype (``I32``, ...), or one holding NaN or inf values.
        InvalidTaskError: `stages` does not divide the layer count, or `layers_per_stage`
            is not a split of it.

    Example:
        >>> from models import hf, make_model
        >>> config, params = hf.load("tests/fixtures/hf/llama", stages=2)
        >>> config.family.value, config.num_kv_heads, config.rope_theta
        ('llama', 2, 50000.0)
        >>> params["blocks_0"]["attn"]["key"]["kernel"].shape
        (32, 2, 8)
        >>> qwen3, _ = hf.load("tests/fixtures/hf/qwen3")
        >>> qwen3.qk_norm, qwen3.head_dim, qwen3.embed_dim // qwen3.num_heads
        (True, 16, 8)
    """
    split = (stages, layers_per_stage)
    return _read(Path(path), split, dtype, vocab_multiple, lambda _c, _p, array: array)


def load_config(path: str | os.PathLike, *, dtype: Any = None) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face folder, from its ``config.json`` alone.

    Args:
        path: The model folder.
        dtype: The config's dtypes; ``None``: the ``dtype`` config.json declares.

    Raises:
        PretrainedConfigError, UnsupportedArchitectureError: As for `load`.

    Example:
        >>> from models import hf
        >>> hf.load_config("tests/fixtures/hf/gpt2").num_layers
        4
    """
    folder = Path(path)
    stored = _config.stored_dtype(_config.read_json(folder / "config.json"))
    return _config.read_config(folder, dtype or stored)[0]


def _placements(
    config: ModelConfig, split: tuple[int | None, Sequence[int] | None], multimesh: mm.MultiMesh
) -> dict:
    stages, layers_per_stage = split
    model = type(make_model(config))(config, stages=stages, layers_per_stage=layers_per_stage)
    batch = int(dict(multimesh.shape).get("data", 1))
    tokens = jax.ShapeDtypeStruct((batch, min(8, config.max_len)), np.int32)
    with multimesh:
        placement = mm.layers.get_placement(model, jax.random.key(0), tokens)
    return {tuple(p.path.split("/")): p.sharding for p in placement.params}


def _check_vocab_split(config: ModelConfig, multimesh: mm.MultiMesh, path: Path) -> None:
    model_axis = int(dict(multimesh.shape).get("model", 1))
    if config.vocab_size % model_axis:
        raise errors.VocabularySplitError(
            f"The vocabulary of {str(path)!r} ({config.vocab_size} ids) does not split over "
            f"the `model` axis of size {model_axis}. Pass `vocab_multiple={model_axis}` to pad "
            f"it to {-(-config.vocab_size // model_axis) * model_axis} ids with zero rows, or "
            "use a `model` axis that divides it."
        )


def load_placed(
    path: str | os.PathLike,
    multimesh: mm.MultiMesh,
    *,
    stages: int | None = None,
    layers_per_stage: Sequence[int] | None = None,
    dtype: Any = None,
    vocab_multiple: int | None = None,
) -> tuple[ModelConfig, dict]:
    """Like `load`, but every tensor goes straight onto its stage's submesh, sharded.

    The shardings are those of the pipelined model (``GPT``/``Llama`` with ``stages`` or
    ``layers_per_stage``) on `multimesh` (axes ``("stage", "data", "model")``, see
    `models.pipeline.make_multimesh`), i.e. exactly where ``mm.parallelize_step`` keeps
    them, so ``state.replace(params=...)`` swaps them into a training state without moving
    anything.

    Args:
        path: The model folder (see `load`).
        multimesh: The ``MultiMesh`` the model will run on.
        stages: The pipeline stage count; must divide the layers and match ``"stage"``.
        layers_per_stage: Or the blocks of every stage (an uneven split, as for ``GPT``
            and ``Llama``); its length must match ``"stage"``. One of the two is required.
        dtype: As for `load`.
        vocab_multiple: As for `load`; required when the vocabulary does not split over
            the ``model`` axis.

    Returns:
        ``(config, params)`` with every parameter a ``jax.Array`` on its submesh.

    Raises:
        VocabularySplitError: The vocabulary does not split over the ``model`` axis.
        InvalidTaskError: Neither `stages` nor `layers_per_stage` is given.
        Everything `load` raises.
    """
    folder = Path(path)
    split = (stages, layers_per_stage)
    if split == (None, None):
        raise errors.InvalidTaskError(
            "`load_placed` puts every tensor on its pipeline stage, so it needs the split: "
            "got neither `stages` nor `layers_per_stage`. Pass `stages=S` (the size of the "
            "MultiMesh's 'stage' axis) or `layers_per_stage=(...)`."
        )
    shardings: dict = {}

    def put(config: ModelConfig, param: ParamPath, array: np.ndarray) -> jax.Array:
        if not shardings:
            _check_vocab_split(config, multimesh, folder)
            shardings.update(_placements(config, split, multimesh))
        return jax.device_put(array, shardings[param])

    return _read(folder, split, dtype, vocab_multiple, put)
