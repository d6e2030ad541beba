"""Llama style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

No layer has a bias and the output head ``lm_head`` has its own weights (untied). The
config's variant fields change the attention only (`models._attention.Attention`): Qwen2's
query/key/value biases (``qkv_bias``), Qwen3's per-head query/key RMSNorm (``qk_norm``),
Llama 3.1's rope scaling (``rope_scaling``) and Mistral's window (``sliding_window``, checked
against the sequence length). The model is a sequence of named stages, so a pipeline can cut
it anywhere:

* `LlamaEmbed` -- the token table ``embed``; returns the residual stream.
* `LlamaBlock` -- pre-norm block (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``). It needs
  the tokens' positions for the rotary embedding.
* `LlamaHead` -- ``final_norm`` then ``lm_head``; returns logits.

`Llama` chains them. Its parameter tree has the top-level keys ``stem`` (``embed``),
``blocks_0`` ... ``blocks_{L-1}`` and ``head`` (``final_norm``, ``lm_head``): each stage's
parameters are one sub-dict. The tree is the same whether or not the model is pipelined, and
however its blocks are split between the stages (``stages`` or ``layers_per_stage``, see
`models.pipeline`).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from ._attention import Attention
from ._decoder import PreNormBlock, StagedDecoder
from ._layers import (
    BATCH,
    EMBED,
    HIDDEN,
    LENGTH,
    MLP,
    VOCAB,
    constrain,
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


class LlamaBlock(PreNormBlock):
    """Pre-norm block: ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``, with
    RMSNorm, grouped-query attention (``config.num_kv_heads`` key/value heads) with rotary
    positions and a SwiGLU MLP.

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

    @nn.nowrap
    def make_norm(self) -> nn.Module:
        return rms_norm(self.config)

    @nn.nowrap
    def make_attention(self) -> nn.Module:
        cfg = self.config
        return Attention(cfg, use_bias=False, use_rope=True, out_std=residual_std(cfg))

    @nn.nowrap
    def make_mlp(self) -> nn.Module:
        return _SwiGLU(self.config)


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


class Llama(StagedDecoder):
    """Llama style decoder-only transformer: `LlamaEmbed`, `LlamaBlock` x L, `LlamaHead`.

    Parameter tree (top level): ``stem``, ``blocks_0`` ... ``blocks_{L-1}``, ``head``.

    Attributes:
        config: Model hyperparameters; ``config.family`` should be ``Family.LLAMA``.
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
        >>> from models import Llama, get_config
        >>> model = Llama(get_config("llama-tiny"))
        >>> tokens = jnp.zeros((2, 8), jnp.int32)
        >>> params = model.init(jax.random.key(0), tokens)["params"]
        >>> list(params)
        ['stem', 'blocks_0', 'blocks_1', 'head']
        >>> model.apply({"params": params}, tokens).shape
        (2, 8, 264)
        >>> Llama(get_config("llama-tiny", num_layers=4), layers_per_stage=(0, 3, 1)).stages
        3
    """

    stem_cls = LlamaEmbed
    block_cls = LlamaBlock
    head_cls = LlamaHead
