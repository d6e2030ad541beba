"""`save`: our config and parameters -> a Hugging Face model folder.

The parameter tree is checked against the tree ``make_model(config)`` would create (paths
and shapes, traced abstractly) before anything is written. Tensors are then converted by
the family's rules (`models.hf._gpt2`, `models.hf._llama`) one file at a time, each
parameter fetched to the host only when its file is written, and the folder appears under
its name only once complete (`models.hf._files.fresh_folder`).

A Llama whose ``lm_head`` is exactly the transpose of its token table (as after loading a
tied checkpoint) is saved tied; otherwise untied.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import linen as nn

from multimesh_flax import errors

from .._factory import make_model
from ..configs import Family, ModelConfig
from . import _config, _files
from ._layout import Rule, get_path
from ._load import family_module
from ._tokenizer import HFTokenizer

MAX_SHARD_SIZE = 5_000_000_000
"""Default largest safetensors file `save` writes, in bytes (Hugging Face's "5GB")."""


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    tokens = jax.ShapeDtypeStruct((1, 1), np.int32)
    shapes = jax.eval_shape(make_model(config).init, jax.random.key(0), tokens)["params"]
    return _flat_shapes(nn.meta.unbox(shapes))


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    out = {}
    for path, leaf in flat:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        out["/".join(keys)] = tuple(np.shape(leaf))
    return out


def _check_params(config: ModelConfig, params: Any) -> None:
    expected, got = _expected_shapes(config), _flat_shapes(params)
    for name in sorted(expected.keys() | got.keys()):
        if name not in got or name not in expected or got[name] != expected[name]:
            raise errors.PretrainedTensorError(
                f"Expected the parameters of {config.family.name} for `config` (parameter "
                f"{name!r} of shape {expected.get(name)}), got {got.get(name, 'nothing')} "
                f"there. Pass the `params` of `make_model(config)` (e.g. `state.params`)."
            )


def _is_tied(config: ModelConfig, params: Any) -> bool:
    if config.family is Family.GPT:
        return True
    table = np.asarray(get_path(params, ("stem", "embed", "embedding")))
    head = np.asarray(get_path(params, ("head", "lm_head", "kernel")))
    return bool(np.array_equal(table, head.T))


def _trim(config: ModelConfig, params: Any, vocab_size: int | None) -> tuple[ModelConfig, Any]:
    if vocab_size is None or vocab_size == config.vocab_size:
        return config, params
    if not isinstance(vocab_size, int) or not 0 < vocab_size < config.vocab_size:
        raise errors.VocabularySplitError(
            f"Expected `vocab_size` between 1 and the model's {config.vocab_size} ids (to cut "
            f"off padding), got {vocab_size!r}."
        )
    params = jax.tree_util.tree_map(lambda x: x, params)  # a copy of the dict structure
    params["stem"]["embed"]["embedding"] = params["stem"]["embed"]["embedding"][:vocab_size]
    if config.family is Family.LLAMA:
        params["head"]["lm_head"]["kernel"] = params["head"]["lm_head"]["kernel"][:, :vocab_size]
    return dataclasses.replace(config, vocab_size=vocab_size), params


def _converted(rule: Rule, params: Any) -> dict[str, np.ndarray]:
    arrays = rule.to_hf([np.asarray(get_path(params, p)) for p in rule.ours])
    return dict(zip(rule.hf, arrays, strict=True))


def _write(folder: Path, rules: list[Rule], params: Any, max_shard_size: int) -> None:
    by_key = {key: rule for rule in rules for key in rule.hf}
    itemsize = {r.hf[0]: np.dtype(get_path(params, r.ours[0]).dtype).itemsize for r in rules}
    sizes = [
        (k, int(np.prod(s, dtype=np.int64)) * itemsize[r.hf[0]])
        for r in rules
        for k, s in zip(r.hf, r.hf_shapes, strict=True)
    ]

    def tensors(keys: list[str]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for rule in dict.fromkeys(by_key[k] for k in keys):
            out.update(_converted(rule, params))
        return {k: out[k] for k in keys}

    _files.write_shards(folder, _files.plan_shards(sizes, max_shard_size), tensors)


def save(
    path: str | os.PathLike,
    config: ModelConfig,
    params: Any,
    *,
    max_shard_size: int = MAX_SHARD_SIZE,
    vocab_size: int | None = None,
    tokenizer: HFTokenizer | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes `config` and `params` as a Hugging Face folder that `load` and transformers read.

    Args:
        path: The folder to create.
        config: The model's `ModelConfig`.
        params: The parameter tree of ``make_model(config)`` (NumPy or JAX arrays, placed
            anywhere); saved in each parameter's own dtype.
        max_shard_size: Largest file in bytes; a bigger model is split into
            ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.
        vocab_size: Cut the vocabulary down to this many ids (undoing `load`'s
            ``vocab_multiple`` padding).
        tokenizer: A tokenizer to write into the folder as ``tokenizer.json`` (its special
            ids go into ``config.json``).
        overwrite: Replace an existing folder at `path`.

    Returns:
        The folder's path.

    Raises:
        PretrainedConfigError: `path` exists and `overwrite` is false.
        PretrainedTensorError: `params` is not the tree of ``make_model(config)``.
        UnsupportedArchitectureError: `config` combines Llama-family variants that no
            Hugging Face architecture `models.hf` writes has together (e.g. ``qkv_bias``
            and ``qk_norm``).
        VocabularySplitError: `vocab_size` is not below ``config.vocab_size``.

    Example:
        >>> import tempfile
        >>> from models import hf
        >>> config, params = hf.load("tests/fixtures/hf/gpt2")
        >>> out = hf.save(tempfile.mkdtemp() + "/gpt2", config, params)
        >>> sorted(p.name for p in out.iterdir())
        ['config.json', 'model.safetensors']
    """
    _config.export_architecture(config)  # refuses a config that no architecture computes
    _check_params(config, params)
    config, params = _trim(config, params, vocab_size)
    tied = _is_tied(config, params)
    rules = family_module(config).rules(config, tied)
    dtype = get_path(params, rules[0].ours[0]).dtype
    hf = _config.hf_config(config, tied, dtype)
    if tokenizer is not None:
        ids = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
        hf.update({f"{k}_token_id": v for k, v in ids.items() if v is not None})
    target = Path(path)
    with _files.fresh_folder(target, overwrite) as folder:
        (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        _write(folder, rules, params, max_shard_size)
        if tokenizer is not None:
            shutil.copy(tokenizer.path, folder / "tokenizer.json")
    return target
