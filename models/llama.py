"""Llama style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

No layer has a bias and the output head ``lm_head`` has its own weights (untied). The model
is a sequence of named stages, so a pipeline can cut it anywhere:

* `LlamaEmbed` -- the token table ``embed``; returns the residual stream.
* `LlamaBlock` -- pre-norm block (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``). It needs
  the tokens' positions for the rotary embedding.
* `LlamaHead` -- ``final_norm`` then ``lm_head``; returns logits.

`Llama` chains them. Its parameter tree has the top-level keys ``stem`` (``embed``),
``blocks_0`` ... ``blocks_{L-1}`` and ``head`` (``final_norm``, ``lm_head``): each stage's
parameters are one sub-dict. The tree is the same whether or not the model is pipelined
(``stages``, see `models.pipeline`).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from . import pipeline
from ._attention import Attention
from ._layers import (
    BATCH,
    EMBED,
    HIDDEN,
    LENGTH,
    MLP,
    VOCAB,
    constrain,
    default_positions,
    dense,
    residual_std,
    rms_norm,
    token_embedding,
)
from .configs import ModelConfig

__all__ = ["Llama", "LlamaBlock", "LlamaEmbed", "LlamaHead"]


class LlamaEmbed(nn.Module):
    """Token embedding: the first stage of `Llama`. Parameters: ``embed/embedding``.

    Attributes:
        config: Model hyperparameters.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from models import LlamaEmbed, get_config
        >>> stem = LlamaEmbed(get_config("llama-tiny"))
        >>> tokens = jnp.zeros((2, 8), jnp.int32)
        >>> params = stem.init(jax.random.key(0), tokens)["params"]
        >>> sorted(params), stem.apply({"params": params}, tokens).shape
        (['embed'], (2, 8, 64))
    """

    config: ModelConfig

    def setup(self):
        self.embed = token_embedding(self.config)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        *,
        deterministic: bool = True,
    ) -> jax.Array:
        """Embeds integer `tokens` ``(batch, length)``.

        `positions` and `deterministic` are unused (positions enter in each block's rotary
        embedding, and there is no embedding dropout); they keep the stem signatures alike.
        """
        del positions, deterministic
        return constrain(self.embed(tokens), HIDDEN)


class _SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with ``gate``, ``up``: embed -> mlp, ``down``: back."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.gate = dense(cfg, cfg.mlp_dim, (EMBED, MLP), use_bias=False)
        self.up = dense(cfg, cfg.mlp_dim, (EMBED, MLP), use_bias=False)
        self.down = dense(cfg, cfg.embed_dim, (MLP, EMBED), use_bias=False, std=residual_std(cfg))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(nn.silu(self.gate(x)) * self.up(x), (BATCH, LENGTH, MLP))
        return constrain(self.down(h), HIDDEN)


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``.

    Attention is grouped-query (``config.num_kv_heads`` key/value heads) with rotary
    positions; the MLP is SwiGLU.

    Attributes:
        config: Model hyperparameters.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from models import LlamaBlock, get_config
        >>> block = LlamaBlock(get_config("llama-tiny"))
        >>> x = jnp.ones((2, 8, 64))
        >>> params = block.init(jax.random.key(0), x)["params"]
        >>> params["attn"]["key"]["kernel"].value.shape  # 2 key/value heads of width 16
        (64, 2, 16)
    """

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.attn_norm = rms_norm(cfg)
        self.attn = Attention(cfg, use_bias=False, use_rope=True, out_std=residual_std(cfg))
        self.mlp_norm = rms_norm(cfg)
        self.mlp = _SwiGLU(cfg)
        self.dropout = nn.Dropout(cfg.dropout_rate)

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
            positions: Absolute positions ``(batch, length)`` for the rotary embedding;
                defaults to ``0 .. length-1``. Pass them when decoding with a cache.
            deterministic: Disables dropout when true (Llama presets have no dropout).
            decode: Use and update the ``"cache"`` collection (see `models._attention`).

        Returns:
            The updated residual stream, same shape as `x`.
        """
        positions = default_positions(x.shape, positions)
        h = self.attn(self.attn_norm(x), positions, deterministic=deterministic, decode=decode)
        x = x + self.dropout(h, deterministic=deterministic)
        h = self.mlp(self.mlp_norm(x))
        return constrain(x + self.dropout(h, deterministic=deterministic), HIDDEN)


class LlamaHead(nn.Module):
    """``final_norm`` then the untied ``lm_head`` projection: the last stage of `Llama`.

    Attributes:
        config: Model hyperparameters.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from models import LlamaHead, get_config
        >>> head = LlamaHead(get_config("llama-tiny"))
        >>> x = jnp.ones((2, 8, 64))
        >>> params = head.init(jax.random.key(0), x)["params"]
        >>> sorted(params), head.apply({"params": params}, x).shape
        (['final_norm', 'lm_head'], (2, 8, 264))
    """

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.final_norm = rms_norm(cfg)
        self.lm_head = dense(cfg, cfg.vocab_size, (EMBED, VOCAB), use_bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Returns logits ``(batch, length, vocab)`` for the residual stream `x`."""
        logits = self.lm_head(self.final_norm(x))
        return constrain(logits, (BATCH, LENGTH, VOCAB))


class Llama(nn.Module):
    """Llama style decoder-only transformer: `LlamaEmbed`, `LlamaBlock` x L, `LlamaHead`.

    Parameter tree (top level): ``stem``, ``blocks_0`` ... ``blocks_{L-1}``, ``head``.

    Attributes:
        config: Model hyperparameters; ``config.family`` should be ``Family.LLAMA``.
        stages: ``None`` (run where called) or a pipeline stage count that divides
            ``config.num_layers``; see `models.pipeline` (needs a current ``MultiMesh``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from models import Llama, get_config
        >>> model = Llama(get_config("llama-tiny"))
        >>> tokens = jnp.zeros((2, 8), jnp.int32)
        >>> params = model.init(jax.random.key(0), tokens)["params"]
        >>> list(params)
        ['stem', 'blocks_0', 'blocks_1', 'head']
        >>> model.apply({"params": params}, tokens).shape
        (2, 8, 264)
    """

    config: ModelConfig
    stages: int | None = None

    def setup(self):
        cfg = self.config
        stages = self.stages
        if stages is not None:
            pipeline.check_stages(cfg.num_layers, stages)
        last = 0 if stages is None else stages - 1
        self.stem = pipeline.on_stage(LlamaEmbed, 0, stages)(cfg)
        self.blocks = [
            pipeline.on_stage(LlamaBlock, self._stage_of(i), stages)(cfg)
            for i in range(cfg.num_layers)
        ]
        self.head = pipeline.on_stage(LlamaHead, last, stages)(cfg)

    def _stage_of(self, index: int) -> int:
        if self.stages is None:
            return 0
        return pipeline.stage_of_block(index, self.config.num_layers, self.stages)

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
            deterministic: Disables dropout when true.
            decode: Use and update the ``"cache"`` collection (see `models.generate`).

        Returns:
            Logits in the config's compute dtype.
        """
        positions = default_positions(tokens.shape, positions)
        x = self.stem(tokens, positions, deterministic=deterministic)
        for block in self.blocks:
            x = block(x, positions, deterministic=deterministic, decode=decode)
        return self.head(x)
