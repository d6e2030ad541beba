"""GPT-2 style decoder: learned positions, LayerNorm, GELU MLP and a tied output head.

The model is a sequence of named stages, so a pipeline can cut it anywhere:

* `GPTEmbed` -- token table ``embed`` plus learned position table ``pos_embed``, then
  dropout. Returns the residual stream ``(batch, length, embed_dim)``.
* `GPTBlock` -- pre-norm transformer block (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``).
* `GPTHead` -- ``final_norm`` then logits against the token table, which is passed in: the
  output head has no weights of its own (the input and output embeddings are tied).

`GPT` chains them. Its parameter tree has the top-level keys ``stem`` (``embed``,
``pos_embed``), ``blocks_0`` ... ``blocks_{L-1}`` and ``head`` (``final_norm``): each stage's
parameters are one sub-dict, ``params["stem"]``, ``params["blocks_i"]``, ``params["head"]``;
``GPTHead`` also takes ``params["stem"]["embed"]["embedding"]`` as an argument. The tree is the
same whether or not the model is pipelined, and however its blocks are split between the
stages (``stages`` or ``layers_per_stage``, see `models.pipeline`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ._attention import Attention
from ._decoder import PreNormBlock, StagedDecoder
from ._layers import (
    BATCH,
    EMBED,
    HIDDEN,
    INIT_STD,
    LENGTH,
    MLP,
    VOCAB,
    check_length,
    constrain,
    default_positions,
    dense,
    layer_norm,
    partitioned,
    residual_std,
    token_embedding,
)
from .configs import ModelConfig

__all__ = ["GPT", "GPTBlock", "GPTEmbed", "GPTHead"]


class GPTEmbed(nn.Module):
    """Token plus learned position embedding: the first stage of `GPT`.

    Parameters: ``embed/embedding`` ``(vocab, embed)`` and ``pos_embed/embedding``
    ``(length, embed)``.

    Attributes:
        config: Model hyperparameters.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from models import GPTEmbed, get_config
        >>> stem = GPTEmbed(get_config("gpt-tiny"))
        >>> tokens = jnp.zeros((2, 8), jnp.int32)
        >>> params = stem.init(jax.random.key(0), tokens)["params"]
        >>> sorted(params), stem.apply({"params": params}, tokens).shape
        (['embed', 'pos_embed'], (2, 8, 64))
    """

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embed = token_embedding(cfg)
        self.pos_embed = nn.Embed(
            cfg.max_len,
            cfg.embed_dim,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            embedding_init=partitioned(nn.initializers.normal(INIT_STD), (LENGTH, EMBED)),
        )
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        *,
        deterministic: bool = True,
    ) -> jax.Array:
        """Embeds integer `tokens` ``(batch, length)`` at `positions` (default ``0..length-1``).

        Raises ``SequenceLengthError`` for positions past the position table (``max_len``).
        """
        check_length(self.config, tokens.shape, positions)
        positions = default_positions(tokens.shape, positions)
        x = self.embed(tokens) + self.pos_embed(positions)
        x = self.dropout(x, deterministic=deterministic)
        return constrain(x, HIDDEN)


class _GeluMLP(nn.Module):
    """``fc`` (embed -> mlp), GELU, ``proj`` (mlp -> embed)."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.fc = dense(cfg, cfg.mlp_dim, (EMBED, MLP), use_bias=True)
        self.proj = dense(cfg, cfg.embed_dim, (MLP, EMBED), use_bias=True, std=residual_std(cfg))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(nn.gelu(self.fc(x)), (BATCH, LENGTH, MLP))
        return constrain(self.proj(h), HIDDEN)


class GPTBlock(PreNormBlock):
    """Pre-norm block: ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``, with
    LayerNorm, biased attention without rotary positions and a GELU MLP.

    Attributes:
        config: Model hyperparameters.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from models import GPTBlock, get_config
        >>> block = GPTBlock(get_config("gpt-tiny"))
        >>> x = jnp.ones((2, 8, 64))
        >>> params = block.init(jax.random.key(0), x)["params"]
        >>> sorted(params), block.apply({"params": params}, x).shape
        (['attn', 'attn_norm', 'mlp', 'mlp_norm'], (2, 8, 64))
    """

    @nn.nowrap
    def make_norm(self) -> nn.Module:
        return layer_norm(self.config)

    @nn.nowrap
    def make_attention(self) -> nn.Module:
        cfg = self.config
        return Attention(cfg, use_bias=True, use_rope=False, out_std=residual_std(cfg))

    @nn.nowrap
    def make_mlp(self) -> nn.Module:
        return _GeluMLP(self.config)


class GPTHead(nn.Module):
    """``final_norm`` then logits against the (tied) token table: the last stage of `GPT`.

    Attributes:
        config: Model hyperparameters.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from models import GPTHead, get_config
        >>> head = GPTHead(get_config("gpt-tiny"))
        >>> x, table = jnp.ones((2, 8, 64)), jnp.ones((264, 64))
        >>> params = head.init(jax.random.key(0), x, table)["params"]
        >>> sorted(params), head.apply({"params": params}, x, table).shape
        (['final_norm'], (2, 8, 264))
    """

    config: ModelConfig

    def setup(self):
        self.final_norm = layer_norm(self.config)

    def __call__(self, x: jax.Array, embedding: jax.Array) -> jax.Array:
        """Returns logits ``(batch, length, vocab)`` for the residual stream `x`.

        Args:
            x: The residual stream ``(batch, length, embed)``.
            embedding: The token table ``(vocab, embed)``, i.e. the (unboxed) value of
                ``params["embed"]["embedding"]``.

        Returns:
            Logits in the config's compute dtype.
        """
        x = self.final_norm(x)
        logits = jnp.einsum("bte,ve->btv", x, jnp.asarray(embedding, self.config.dtype))
        return constrain(logits, (BATCH, LENGTH, VOCAB))


class GPT(StagedDecoder):
    """GPT-2 style decoder-only transformer: `GPTEmbed`, `GPTBlock` x L, `GPTHead`.

    Parameter tree (top level): ``stem``, ``blocks_0`` ... ``blocks_{L-1}``, ``head``.
    The output head reuses ``stem/embed`` (tied embeddings).

    Attributes:
        config: Model hyperparameters; ``config.family`` should be ``Family.GPT``.
        stages: ``None`` (run where called) or a pipeline stage count that divides
            ``config.num_layers``: an even split; see `models.pipeline` (needs a current
            ``MultiMesh``).
        layers_per_stage: ``None`` or the blocks of every stage (e.g. ``(1, 3, 3, 1)``),
            adding up to ``config.num_layers``: an uneven split, instead of ``stages``. The
            stem goes with the first stage and the head with the last, so only those may
            hold no block.

    Raises:
        InvalidTaskError: ``stages`` does not divide the blocks, or ``layers_per_stage`` is
            not a split of them (see `models.pipeline.get_layers_per_stage`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from models import GPT, get_config
        >>> model = GPT(get_config("gpt-tiny"))
        >>> tokens = jnp.zeros((2, 8), jnp.int32)
        >>> params = model.init(jax.random.key(0), tokens)["params"]
        >>> list(params)
        ['stem', 'blocks_0', 'blocks_1', 'head']
        >>> model.apply({"params": params}, tokens).shape
        (2, 8, 264)

        Pipelined unevenly, one block on stage 0 (with the stem) and three on stage 1:

        >>> import multimesh_flax as mm
        >>> from models.pipeline import make_multimesh
        >>> staged = GPT(get_config("gpt-tiny", num_layers=4), layers_per_stage=(1, 3))
        >>> staged.stages
        2
        >>> with make_multimesh(2, 2, 2):
        ...     placement = mm.layers.get_placement(staged, jax.random.key(0), tokens)
        >>> {p.task: min(d.id for d in p.sharding.device_set) for p in placement.params}
        {'blocks_0': 0, 'blocks_1': 4, 'blocks_2': 4, 'blocks_3': 4, 'head': 4, 'stem': 0}
    """

    stem_cls = GPTEmbed
    block_cls = GPTBlock
    head_cls = GPTHead

    def logits(self, x: jax.Array) -> jax.Array:
        """The head against the stem's token table (tied embeddings)."""
        return self.head(x, self.stem.embed.embedding)
