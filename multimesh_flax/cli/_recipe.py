"""What an ``mmflax`` run is made of: model, optimizer, loss and data.

`_train` (``mmflax train``) and `_sample` (``mmflax sample``) build the same things from the
same saved settings, so they share this module:

* `model_config` resolves a preset name and a layer count into a `models.ModelConfig`
  (`run_config` also reads it from a Hugging Face folder given as ``init_from``);
  `make_model` builds the model for it, pipelined over ``stages`` (or the uneven
  ``layers_per_stage``) or unstaged (``None``). The parameter tree is the same either way, so
  a checkpoint moves between them.
* `compute_config`: the config a ``--precision`` computes in (bfloat16 activations for
  ``bf16`` and ``pure-bf16``). The optimizer lives in `_optimizer`.
* `lm_loss` is the next-token cross entropy in ``parallelize_step``'s ``loss_fn`` form.
* `make_tokenizer`: the byte tokenizer, or the ``tokenizer.json`` of an ``init_from`` folder.
* `batch_stream` yields the run's batches from step ``start`` on: batch ``i`` is the same
  whether a run starts at 0 or resumes at ``i``. With ``accumulate`` K (``--grad-accum``) a
  step's batch is K consecutive batches stacked into one of K times the rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from models import GPT, ByteTokenizer, Family, Llama, ModelConfig, cross_entropy_loss, get_config
from models import iterate_batches as _iterate_batches
from models import load_corpus as _load_corpus
from multimesh_flax.cli.errors import RunOptionError

Batch = dict[str, np.ndarray]

TOKENIZER = ByteTokenizer()
"""Byte-level tokenizer of every run (264 ids, the vocabulary of the ``*-tiny`` presets)."""


def model_config(preset: str, layers: int | None = None) -> ModelConfig:
    """The preset ``preset`` with ``layers`` blocks (``None``: the preset's own count)."""
    overrides = {} if layers is None else {"num_layers": layers}
    return get_config(preset, **overrides)


def run_config(model: str, layers: int | None, init_from: str | None) -> ModelConfig:
    """The config of a run: the preset ``model``, or the Hugging Face folder ``init_from``.

    A pretrained model trains in float32 whatever dtype its checkpoint stores.

    Raises:
        RunOptionError: ``layers`` differs from the pretrained model's layer count.
    """
    if init_from is None:
        return model_config(model, layers)
    from models import hf

    config = hf.load_config(init_from, dtype=np.float32)
    if layers is not None and layers != config.num_layers:
        raise RunOptionError(
            f"`--layers` {layers} differs from the {config.num_layers} layers of the "
            f"checkpoint in '{init_from}'. Drop `--layers` when fine-tuning with `--init-from`."
        )
    return config


def make_tokenizer(init_from: str | None) -> Any:
    """The tokenizer of a run: ``init_from``'s ``tokenizer.json`` if it has one, else bytes.

    Without a tokenizer.json, a checkpoint's ids 0-258 are read as bytes and specials (as
    for the presets), and its vocabulary as a padded byte vocabulary.

    Raises:
        RunOptionError: ``init_from`` has no tokenizer.json and a vocabulary too small for
            the byte tokenizer's ids.
    """
    if init_from is None:
        return TOKENIZER
    from models import hf

    if (Path(init_from) / "tokenizer.json").is_file():
        return hf.HFTokenizer.from_folder(init_from)
    vocab = hf.load_config(init_from).vocab_size
    if vocab <= TOKENIZER.pad_id:
        raise RunOptionError(
            f"'{init_from}' has no tokenizer.json, and its {vocab}-id vocabulary cannot hold "
            f"the byte tokenizer's ids (0-{TOKENIZER.pad_id}). Add the checkpoint's "
            "tokenizer.json to the folder."
        )
    return ByteTokenizer(multiple=vocab)  # byte ids; decodes every id the model can emit


def make_model(
    config: ModelConfig,
    stages: int | None = None,
    layers_per_stage: tuple[int, ...] | None = None,
    stage_submeshes: tuple[int, ...] | None = None,
) -> nn.Module:
    """``GPT`` or ``Llama`` for ``config``, in ``stages`` pipeline stages (``None``: unstaged),
    or split as ``layers_per_stage`` says (the blocks of every stage); ``stage_submeshes``:
    each stage's index on the mesh (default: its own)."""
    family = GPT if config.family is Family.GPT else Llama
    return family(
        config, stages=stages, layers_per_stage=layers_per_stage, stage_submeshes=stage_submeshes
    )


def compute_config(config: ModelConfig, precision: str) -> ModelConfig:
    """``config`` computing in bfloat16 for ``precision`` ``bf16``/``pure-bf16``, else as is.

    The reference models cast to their config's ``dtype`` inside every layer, so the
    step's bfloat16 parameters alone would not make them compute in bfloat16. The
    parameters stay in ``param_dtype``; what stores them is ``parallelize_step``'s business.
    """
    if precision == "fp32":
        return config
    return dataclasses.replace(config, dtype=jnp.bfloat16)


def lm_loss(model_fn: Callable[..., jax.Array], batch: Batch) -> jax.Array:
    """Mean next-token cross entropy of ``model_fn(batch["inputs"])`` against the targets."""
    return cross_entropy_loss(model_fn(batch["inputs"]), batch["targets"])


def corpus_tokens(corpus: str, tokenizer: Any = TOKENIZER) -> np.ndarray:
    """The token ids of the shipped corpus ``corpus`` (see `models.data.load_corpus`)."""
    return tokenizer.encode(_load_corpus(corpus))


def batch_stream(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    seed: int,
    start: int = 0,
    accumulate: int = 1,
) -> Iterator[Batch]:
    """The run's batches of steps ``start, start + 1, ...`` as ``{"inputs", "targets"}``.

    With ``accumulate`` K, step ``i``'s batch is batches ``K i, ..., K i + K - 1`` of
    ``batch_size`` rows, stacked (``--grad-accum``).
    """
    windows = _iterate_batches(tokens, batch_size=batch_size, seq_len=seq_len, seed=seed)
    windows = itertools.islice(windows, start * accumulate, None)
    if accumulate == 1:
        for inputs, targets in windows:
            yield {"inputs": inputs, "targets": targets}
        return
    while group := list(itertools.islice(windows, accumulate)):
        inputs, targets = zip(*group, strict=True)
        yield {"inputs": np.concatenate(inputs), "targets": np.concatenate(targets)}


def example_batch(batch_size: int, seq_len: int) -> dict[str, Any]:
    """Shapes of one batch, for tracing."""
    shape = jax.ShapeDtypeStruct((batch_size, seq_len), np.int32)
    return {"inputs": shape, "targets": shape}
