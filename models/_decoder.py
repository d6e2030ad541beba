"""What GPT and Llama share: the pre-norm block and the staged decoder around the blocks.

* `PreNormBlock` -- ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``, with dropout
  on both branches. A family says which norm, attention and MLP it uses (``make_norm``,
  ``make_attention``, ``make_mlp``); parameter names are the same for every family.
* `StagedDecoder` -- ``stem``, ``blocks_0`` ... ``blocks_{L-1}``, ``head``, each placed on
  its pipeline stage when ``stages`` or ``layers_per_stage`` is set (`models.pipeline`). A
  family names its three stage classes (``stem_cls``, ``block_cls``, ``head_cls``) and, if
  its head takes more than the residual stream, overrides ``logits``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import flax.linen as nn
import jax

from . import pipeline
from ._layers import HIDDEN, check_length, constrain, default_positions
from .configs import ModelConfig


class PreNormBlock(nn.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``.

    Subclasses implement ``make_norm``, ``make_attention`` and ``make_mlp``.

    Attributes:
        config: Model hyperparameters.
    """

    config: ModelConfig

    @nn.nowrap
    def make_norm(self) -> nn.Module:
        raise NotImplementedError

    @nn.nowrap
    def make_attention(self) -> nn.Module:
        raise NotImplementedError

    @nn.nowrap
    def make_mlp(self) -> nn.Module:
        raise NotImplementedError

    def setup(self):
        self.attn_norm = self.make_norm()
        self.attn = self.make_attention()
        self.mlp_norm = self.make_norm()
        self.mlp = self.make_mlp()
        self.dropout = nn.Dropout(self.config.dropout_rate)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array | None = None,
        *,
        deterministic: bool = True,
        decode: bool = False,
    ) -> jax.Array:
        """Updates the residual stream `x` ``(batch, length, embed)``.

        Args:
            x: The residual stream.
            positions: Absolute positions ``(batch, length)``, defaulting to
                ``0 .. length-1``; used by rotary attention, accepted by every block so all
                have the same signature. Pass them when decoding with a cache.
            deterministic: Disables dropout when true.
            decode: Use and update the ``"cache"`` collection (see `models._attention`).

        Returns:
            The updated residual stream, same shape as `x`.
        """
        positions = default_positions(x.shape, positions)
        h = self.attn(self.attn_norm(x), positions, deterministic=deterministic, decode=decode)
        x = x + self.dropout(h, deterministic=deterministic)
        h = self.mlp(self.mlp_norm(x))
        return constrain(x + self.dropout(h, deterministic=deterministic), HIDDEN)


class StagedDecoder(nn.Module):
    """``stem``, ``blocks_0`` ... ``blocks_{L-1}``, ``head``, optionally one task per stage.

    ``stages`` and ``layers_per_stage`` are checked when the module is built; with
    ``layers_per_stage`` alone, ``stages`` is set to its length. The parameter names do not
    depend on either, so parameters move between any two splits unchanged.

    Attributes:
        config: Model hyperparameters.
        stages: ``None`` (run where called, unless ``layers_per_stage`` is given) or a
            pipeline stage count that divides ``config.num_layers``: an even split; see
            `models.pipeline` (needs a current ``MultiMesh``).
        layers_per_stage: ``None`` or the blocks of every stage, in order, adding up to
            ``config.num_layers`` (e.g. ``(1, 3, 3, 1)``): an uneven split. The stem goes
            with the first stage and the head with the last, so only those may hold no
            block.
        stage_submeshes: ``None`` (stage ``s`` on index ``s`` of the ``MultiMesh``'s
            ``stage`` axis) or that index for every stage, e.g. ``(0, 1, 1, 0)`` for a V
            schedule (``mm.core.declare.stage_rows("zero-bubble-v", 4, 2)``).

    Raises:
        InvalidTaskError: ``stages`` does not divide the blocks, or ``layers_per_stage`` is
            not a valid split of them or disagrees with ``stages``
            (`models.pipeline.get_layers_per_stage`), or ``stage_submeshes`` does not give
            one index per stage.
    """

    config: ModelConfig
    stages: int | None = None
    layers_per_stage: Sequence[int] | None = None
    stage_submeshes: Sequence[int] | None = None

    stem_cls: ClassVar[type[nn.Module]]
    block_cls: ClassVar[type[nn.Module]]
    head_cls: ClassVar[type[nn.Module]]

    def __post_init__(self):
        split = pipeline.get_layers_per_stage(
            self.config.num_layers, self.stages, self.layers_per_stage
        )
        if split is not None and self.layers_per_stage is not None:  # hashable; the stage count
            object.__setattr__(self, "layers_per_stage", split)
            object.__setattr__(self, "stages", len(split))
        if self.stage_submeshes is not None:
            submeshes = pipeline.check_stage_submeshes(self.stage_submeshes, split)
            object.__setattr__(self, "stage_submeshes", submeshes)
        super().__post_init__()

    def setup(self):
        cfg = self.config
        split = pipeline.get_layers_per_stage(cfg.num_layers, self.stages, self.layers_per_stage)
        staged = split is not None
        where = pipeline.block_stages(split) if staged else (0,) * cfg.num_layers
        last = len(split) - 1 if staged else 0
        at = self.stage_submeshes or range(last + 1)
        self.stem = pipeline.on_stage(self.stem_cls, at[0], staged)(cfg)
        self.blocks = [pipeline.on_stage(self.block_cls, at[stage], staged)(cfg) for stage in where]
        self.head = pipeline.on_stage(self.head_cls, at[last], staged)(cfg)

    def logits(self, x: jax.Array) -> jax.Array:
        """The head applied to the final residual stream."""
        return self.head(x)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        *,
        deterministic: bool = True,
        decode: bool = False,
    ) -> jax.Array:
        """Returns next-token logits ``(batch, length, vocab)`` for integer `tokens`.

        Args:
            tokens: Token ids, shape ``(batch, length)``.
            positions: Absolute positions of `tokens`, shape ``(batch, length)``; defaults
                to ``0 .. length-1``. Pass them when decoding with a cache.
            deterministic: Disables dropout when true (needs a ``"dropout"`` rng otherwise).
            decode: Use and update the ``"cache"`` collection (see `models.generate`).

        Returns:
            Logits in the config's compute dtype.

        Raises:
            SequenceLengthError: `tokens` longer than ``config.max_len`` (or concrete
                `positions` reaching it), detected while tracing.
        """
        check_length(self.config, tokens.shape, positions)
        positions = default_positions(tokens.shape, positions)
        x = self.stem(tokens, positions, deterministic=deterministic)
        for block in self.blocks:
            x = block(x, positions, deterministic=deterministic, decode=decode)
        return self.logits(x)
