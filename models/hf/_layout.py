"""How Hugging Face tensors map onto our parameter tree: one `Rule` per group of tensors.

A `Rule` ties one or more Hugging Face tensors (by key, with their expected shapes) to one
or more of our parameters (by path in the `GPT`/`Llama` tree) with two NumPy functions, one
each way. Most rules are one tensor to one parameter with a transpose or reshape; GPT-2's
fused ``c_attn`` is one tensor to three (query, key, value), and a tied Llama head is one
tensor (``embed_tokens``) to two (``embed`` and ``lm_head``). The family modules
(`models.hf._gpt2`, `models.hf._llama`) list their rules; `models.hf._load` and
`models.hf._save` only walk the list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

Path = tuple[str, ...]
Convert = Callable[[Sequence[np.ndarray]], list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """Hugging Face tensors `hf` (shapes `hf_shapes`) <-> our parameters at `ours`.

    Attributes:
        hf: Hugging Face keys, in the canonical (prefixed) form.
        hf_shapes: The shape each of them must have for the config.
        ours: Paths in our parameter tree, e.g. ``("blocks_0", "attn", "query", "kernel")``.
        to_ours: Arrays of `hf` (in order) -> arrays of `ours`.
        to_hf: Arrays of `ours` -> arrays of `hf`.
    """

    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    ours: tuple[Path, ...]
    to_ours: Convert
    to_hf: Convert


def same(hf: str, shape: tuple[int, ...], ours: Path) -> Rule:
    """A tensor stored identically on both sides."""
    return Rule((hf,), (shape,), (ours,), list, list)


def transposed(hf: str, shape: tuple[int, int], ours: Path) -> Rule:
    """A ``torch.nn.Linear`` weight ``(out, in)`` <-> our ``(in, out)`` kernel."""
    flip: Convert = lambda xs: [np.ascontiguousarray(xs[0].T)]
    return Rule((hf,), (shape,), (ours,), flip, flip)


def reshaped(hf: str, shape: tuple[int, ...], ours: Path, our_shape: tuple[int, ...]) -> Rule:
    """A tensor whose flat HF shape is split into more axes on our side (no data moves)."""
    return Rule(
        (hf,),
        (shape,),
        (ours,),
        lambda xs: [xs[0].reshape(our_shape)],
        lambda xs: [xs[0].reshape(shape)],
    )


def transposed_reshaped(
    hf: str, shape: tuple[int, int], ours: Path, our_shape: tuple[int, ...]
) -> Rule:
    """A ``Linear`` weight ``(out, in)``, transposed to ``(in, out)``, then reshaped."""
    return Rule(
        (hf,),
        (shape,),
        (ours,),
        lambda xs: [np.ascontiguousarray(xs[0].T).reshape(our_shape)],
        lambda xs: [np.ascontiguousarray(xs[0].reshape(shape[::-1]).T)],
    )


def get_path(tree: dict, path: Path) -> np.ndarray:
    """The leaf at `path` of a nested dict."""
    for key in path:
        tree = tree[key]
    return tree  # type: ignore[return-value]


def set_path(tree: dict, path: Path, value: np.ndarray) -> None:
    """Stores `value` at `path` of a nested dict, creating the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
