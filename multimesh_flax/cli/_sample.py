"""Text from a model: ``mmflax sample`` and the before/after samples of ``mmflax train``.

`generate_text` continues a prompt with `models.generate` on one device, greedily or by
sampling. `restore_params` reads the latest checkpoint of a run folder onto one device for the
unstaged model -- the parameter tree does not depend on the pipeline layout it was trained
with -- and `sample` strings the two together for the command line. `corpus_match_rate`
measures how much a text looks like the corpus: the fraction of its 4-character windows that
occur there.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from models import ModelConfig, generate
from multimesh_flax import errors
from multimesh_flax.checkpoint import Checkpointer
from multimesh_flax.cli import _optimizer, _recipe
from multimesh_flax.cli.errors import RunOptionError
from multimesh_flax.layers import TrainState

DEFAULT_PROMPT = "Shall I "
CHECKPOINT_DIR = "checkpoint"


def generate_text(
    model: nn.Module,
    params: Any,
    prompt: str,
    tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    tokenizer: Any = _recipe.TOKENIZER,
) -> str:
    """``prompt`` followed by ``tokens`` generated tokens (greedy when ``temperature`` is 0)."""
    ids = tokenizer.encode(prompt)[None]
    rng = jax.random.key(seed)
    out = generate(model, params, ids, tokens, rng=rng, temperature=temperature, top_k=top_k)
    return tokenizer.decode(np.asarray(out[0]))


def check_length(
    config: ModelConfig, prompt: str, tokens: int, tokenizer: Any = _recipe.TOKENIZER
) -> None:
    """Raises ``RunOptionError`` unless the prompt plus ``tokens`` fits ``config.max_len``."""
    length = len(tokenizer.encode(prompt))
    if tokens < 0 or length + tokens > config.max_len:
        raise RunOptionError(
            f"Expected `--tokens` between 0 and {max(config.max_len - length, 0)} (the model "
            f"reads at most {config.max_len} tokens and the prompt takes {length}), got "
            f"{tokens}. Ask for fewer tokens or use a shorter `--prompt`."
        )


def default_tokens(prompt: str, trained_len: int, tokenizer: Any = _recipe.TOKENIZER) -> int:
    """How many tokens to generate after ``prompt``: up to the length the model trained on.

    Beyond the trained sequence length GPT's learned positions are untrained and the text
    falls apart; ``--tokens`` can still ask for more, up to the model's ``max_len``.
    """
    return max(0, trained_len - len(tokenizer.encode(prompt)))


def corpus_match_rate(text: str, corpus: str, n: int = 4) -> float:
    """The fraction of ``text``'s ``n``-character windows that also occur in ``corpus``.

    Random bytes score near 0, text copied from the corpus 1; 0 for texts shorter than ``n``.

    Example:
        >>> corpus_match_rate("thee qz", "Shall I compare thee to a summer's day?")
        0.5
    """
    windows = [text[i : i + n] for i in range(len(text) - n + 1)]
    if not windows:
        return 0.0
    known = {corpus[i : i + n] for i in range(len(corpus) - n + 1)}
    return sum(w in known for w in windows) / len(windows)


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory of run folder ``path`` (or ``path`` itself if it is one).

    Raises:
        CheckpointNotFoundError: neither ``path/checkpoint`` nor ``path`` holds a checkpoint.
    """
    path = Path(path).absolute()  # orbax needs absolute paths
    for candidate in (path / CHECKPOINT_DIR, path):
        if candidate.is_dir() and Checkpointer(candidate, read_only=True).all_steps():
            return candidate
    raise errors.CheckpointNotFoundError(
        f"Expected a run folder written by `mmflax train` (with a `{CHECKPOINT_DIR}/` inside), "
        f"but '{path}' holds no finalized checkpoint. Pass the `--out` folder of a finished run."
    )


def restore_params(path: str | Path) -> tuple[ModelConfig, Any, dict[str, Any]]:
    """``(config, params, metadata)`` of the latest checkpoint in run folder ``path``.

    The parameters land on the first device, in the unstaged model's (identical) tree.
    """
    with Checkpointer(find_checkpoint(path), read_only=True) as ckpt:
        metadata = ckpt.metadata()
        run = metadata["run"]
        config = _recipe.run_config(run["model"], run["layers"], run.get("init_from"))
        target = _abstract_state(config, run, metadata.get("target_step"))
        state = ckpt.restore(target=target)
    params = jax.tree.map(lambda x: x.astype(np.float32), state.params)  # pure-bf16 runs
    return config, params, metadata


def _abstract_state(config: ModelConfig, run: Mapping[str, Any], horizon: int | None) -> Any:
    """The run's state as it was saved, on the first device: what a restore reads into.

    A ``--precision pure-bf16`` run stores every float of its state in bfloat16.
    """
    model = _recipe.make_model(config)
    optimizer = _optimizer.make_optimizer(_optimizer.OptimizerSettings.of(run), horizon)
    example = _recipe.example_batch(1, 1)["inputs"]

    def create() -> Any:
        params = nn.meta.unbox(model.init(jax.random.key(0), example)["params"])
        return TrainState.create(apply_fn=model.apply, params=params, tx=optimizer)

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pure = run.get("precision") == "pure-bf16"

    def saved(s: Any) -> Any:
        dtype = jnp.bfloat16 if pure and jnp.issubdtype(s.dtype, jnp.floating) else s.dtype
        return jax.ShapeDtypeStruct(s.shape, dtype, sharding=sharding)

    return jax.tree.map(saved, jax.eval_shape(create))


def sample(
    path: str | Path,
    prompt: str = DEFAULT_PROMPT,
    tokens: int | None = None,
    *,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """Text from the model saved in run folder ``path``: ``prompt`` plus ``tokens`` more.

    ``tokens=None`` generates up to the sequence length the run trained on.

    Raises:
        CheckpointNotFoundError: ``path`` holds no checkpoint.
        RunOptionError: the prompt and ``tokens`` exceed the model's ``max_len``, or
            ``temperature``/``top_k`` are out of range.
    """
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise RunOptionError(
            f"Expected `--temperature` >= 0 and `--top-k` >= 1, got {temperature} and {top_k}. "
            "Use temperature 0 for greedy decoding."
        )
    config, params, metadata = restore_params(path)
    tokenizer = _recipe.make_tokenizer(metadata["run"].get("init_from"))
    if tokens is None:
        tokens = default_tokens(prompt, metadata["run"]["seq_len"], tokenizer)
    check_length(config, prompt, tokens, tokenizer)
    model = _recipe.make_model(config)
    return generate_text(
        model,
        params,
        prompt,
        tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        tokenizer=tokenizer,
    )
