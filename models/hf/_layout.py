"""How Hugging Face tensors map onto our parameter tree: one `Rule` per group of tensors.

A `Rule` ties one or more Hugging Face tensors (by key, with their expected shapes) to one
or more of our parameters (by path in the `GPT`/`Llama` tree) with two NumPy functions, one
each way. Most rules are one tensor to one parameter whose axes an einops pattern regroups or
reorders (`rearranged`, e.g. ``"(heads head_dim) embed -> embed heads head_dim"``); GPT-2's
fused ``c_attn`` is one tensor to three (query, key, value), and a tied Llama head is one
tensor (``embed_tokens``) to two (``embed`` and ``lm_head``). The family modules
(`models.hf._gpt2`, `models.hf._llama`) list their rules; `models.hf._load` and
`models.hf._save` only walk the list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import einops
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
    return rearranged(hf, shape, ours, "d_out d_in -> d_in d_out")


def rearranged(hf: str, shape: tuple[int, ...], ours: Path, pattern: str, **sizes: int) -> Rule:
    """A tensor whose axes an einops `pattern` regroups or reorders, HF's side on the left.

    The way back is `pattern` read right to left; `sizes` name the lengths that splitting a
    grouped axis needs (``head_dim=...`` for ``"(heads head_dim) embed -> ..."``).

    Example:
        >>> rule = rearranged("w", (6, 4), ("k",), "(heads head_dim) e -> e heads head_dim",
        ...                   head_dim=3)
        >>> ours = rule.to_ours([np.arange(24).reshape(6, 4)])[0]
        >>> ours.shape, ours[1, 0].tolist()
        ((4, 2, 3), [1, 5, 9])
        >>> np.array_equal(rule.to_hf([ours])[0], np.arange(24).reshape(6, 4))
        True
    """
    hf_axes, our_axes = pattern.split("->")
    back = f"{our_axes} -> {hf_axes}"
    return Rule(
        (hf,),
        (shape,),
        (ours,),
        lambda xs: [np.ascontiguousarray(einops.rearrange(xs[0], pattern, **sizes))],
        lambda xs: [np.ascontiguousarray(einops.rearrange(xs[0], back, **sizes))],
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
