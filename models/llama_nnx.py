"""The Llama style decoder in Flax NNX, variable for variable the Linen `models.Llama`.

Same architecture (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, untied
``lm_head``, no biases; with the config's variants: ``qkv_bias``, ``qk_norm``,
``rope_scaling``, ``sliding_window``) and the same variable paths as the Linen parameter tree:
``stem/embed/embedding``, ``blocks_<i>/{attn_norm,attn,mlp_norm,mlp}/...`` (``attn/query``,
``key``, ``value``, ``out`` kernels of the same 3-D shapes, ``mlp/gate``, ``up``, ``down``) and
``head/{final_norm,lm_head}``. So :func:`load_linen_params` puts a Linen checkpoint into the
NNX model unchanged, and both give the same logits. Every variable carries the Linen model's
logical names as its ``out_sharding``, and activations are constrained with
``multimesh_flax.with_sharding_constraint`` (the identity when called eagerly).

With ``stages=S`` or ``layers_per_stage=(n_0, ..., n_{S-1})`` the stem, blocks and head are
``Task[...]`` modules on the stages of a ``("stage", "data", "model")`` MultiMesh exactly as
in `models.pipeline`: stem on stage 0, the blocks in order (``L / S`` per stage, or ``n_s``
on stage ``s``), head on stage ``S - 1``; constructed inside ``with multi_mesh:``, each
stage's variables are born on its submesh. The variable paths do not depend on the split.
Not ported: the KV cache (``decode``); use the Linen model for generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import multimesh_flax as mm

from . import pipeline
from ._attention import _attend, apply_rotary, causal_mask
from ._layers import (
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INIT_STD,
    KV_HEADS,
    LENGTH,
    MLP,
    VOCAB,
    check_length,
    default_positions,
    residual_std,
)
from .configs import ModelConfig

__all__ = ["LlamaNNX", "NNX_LOGICAL_RULES", "load_linen_params"]

NNX_LOGICAL_RULES = (*pipeline.LOGICAL_RULES, (EMBED, None), (HEAD_DIM, None), (LENGTH, None))
"""`models.pipeline.LOGICAL_RULES` plus the names that stay replicated (a ``Task[Block]``
wants a rule for every logical name its variables use)."""


def _constrain(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    return mm.with_sharding_constraint(x, P(*names))


def _normal(std: float, names: tuple[str, ...]) -> Any:
    return nnx.with_partitioning(nnx.initializers.normal(std), names)


class _Projection(nnx.Module):
    """``einsum(equation, x, kernel)`` with a 3-D ``kernel`` (Linen's ``_Projection``), plus
    a ``bias`` over the two output axes when `use_bias` (the query/key/value projections)."""

    def __init__(
        self,
        cfg: ModelConfig,
        shape: tuple[int, ...],
        names: tuple[str, ...],
        equation: str,
        std: float,
        *,
        use_bias: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        self.kernel = nnx.Param(_normal(std, names)(rngs.params(), shape, cfg.param_dtype))
        zeros = nnx.with_partitioning(nnx.initializers.zeros_init(), names[1:])
        bias = nnx.Param(zeros(rngs.params(), shape[1:], cfg.param_dtype)) if use_bias else None
        self.bias = bias
        self.equation, self.dtype = equation, cfg.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel.get_value().astype(self.dtype)
        y = jnp.einsum(self.equation, x.astype(self.dtype), kernel)
        if self.bias is None:
            return y
        return y + self.bias.get_value().astype(self.dtype)


def _rms_norm(
    cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None, name: str = EMBED
) -> nnx.RMSNorm:
    """RMSNorm over the residual stream, or over `width` features named `name`."""
    return nnx.RMSNorm(
        cfg.embed_dim if width is None else width,
        epsilon=cfg.norm_eps,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), (name,)),
        rngs=rngs,
    )


def _linear(
    cfg: ModelConfig, d_in: int, d_out: int, names: tuple[str, str], std: float, rngs: nnx.Rngs
) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=_normal(std, names),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions; biases on the query, key
    and value projections only with ``qkv_bias``, a per-head RMSNorm of queries and keys
    (``query_norm``, ``key_norm``) only with ``qk_norm``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        assert cfg.num_kv_heads is not None and cfg.head_dim is not None
        e, h, k, d = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        project, bias = "bte,ehd->bthd", cfg.qkv_bias
        self.query = _Projection(
            cfg, (e, h, d), (EMBED, HEADS, HEAD_DIM), project, INIT_STD, use_bias=bias, rngs=rngs
        )
        self.key = _Projection(
            cfg, (e, k, d), (EMBED, KV_HEADS, HEAD_DIM), project, INIT_STD, use_bias=bias, rngs=rngs
        )
        self.value = _Projection(
            cfg, (e, k, d), (EMBED, KV_HEADS, HEAD_DIM), project, INIT_STD, use_bias=bias, rngs=rngs
        )
        self.out = _Projection(
            cfg, (h, d, e), (HEADS, HEAD_DIM, EMBED), "bthd,hde->bte", residual_std(cfg), rngs=rngs
        )
        self.query_norm = _rms_norm(cfg, rngs, d, HEAD_DIM) if cfg.qk_norm else None
        self.key_norm = _rms_norm(cfg, rngs, d, HEAD_DIM) if cfg.qk_norm else None
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling

    def __call__(self, x: jax.Array, positions: jax.Array, *, deterministic: bool) -> jax.Array:
        q = _constrain(self.query(x), (BATCH, LENGTH, HEADS, HEAD_DIM))
        k = _constrain(self.key(x), (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
        v = _constrain(self.value(x), (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
        if self.query_norm is not None and self.key_norm is not None:
            q, k = self.query_norm(q), self.key_norm(k)
        q = apply_rotary(q, positions, self.rope_theta, self.rope_scaling)
        k = apply_rotary(k, positions, self.rope_theta, self.rope_scaling)
        mask = causal_mask(q.shape[1], k.shape[1])

        def dropout(p: jax.Array) -> jax.Array:
            return self.dropout(p, deterministic=deterministic)

        out = _constrain(_attend(q, k, v, mask, dropout), (BATCH, LENGTH, HEADS, HEAD_DIM))
        return _constrain(self.out(out), HIDDEN)


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        e, m = cfg.embed_dim, cfg.mlp_dim
        self.gate = _linear(cfg, e, m, (EMBED, MLP), INIT_STD, rngs)
        self.up = _linear(cfg, e, m, (EMBED, MLP), INIT_STD, rngs)
        self.down = _linear(cfg, m, e, (MLP, EMBED), residual_std(cfg), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = _constrain(jax.nn.silu(self.gate(x)) * self.up(x), (BATCH, LENGTH, MLP))
        return _constrain(self.down(h), HIDDEN)


class LlamaEmbedNNX(nnx.Module):
    """The token table ``embed/embedding``: the first stage."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.embed_dim,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            embedding_init=_normal(INIT_STD, (VOCAB, EMBED)),
            rngs=rngs,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return _constrain(self.embed(tokens), HIDDEN)


class LlamaBlockNNX(nnx.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = _rms_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _rms_norm(cfg, rngs)
        self.mlp = SwiGLU(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, *, deterministic: bool) -> jax.Array:
        h = self.attn(self.attn_norm(x), positions, deterministic=deterministic)
        x = x + self.dropout(h, deterministic=deterministic)
        h = self.mlp(self.mlp_norm(x))
        return _constrain(x + self.dropout(h, deterministic=deterministic), HIDDEN)


class LlamaHeadNNX(nnx.Module):
    """``final_norm`` then the untied ``lm_head``: the last stage."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.final_norm = _rms_norm(cfg, rngs)
        self.lm_head = _linear(cfg, cfg.embed_dim, cfg.vocab_size, (EMBED, VOCAB), INIT_STD, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _constrain(self.lm_head(self.final_norm(x)), (BATCH, LENGTH, VOCAB))


def _on_stage(cls: type, stage: int, staged: bool) -> type:
    if not staged:
        return cls
    return mm.task(cls, mesh_slice={"stage": stage}, logical_axes=NNX_LOGICAL_RULES)


class LlamaNNX(nnx.Module):
    """Llama style decoder in NNX: ``stem``, ``blocks_0`` ... ``blocks_{L-1}``, ``head``.

    Args:
        config: Model hyperparameters (``models.get_config("llama-tiny")``, ...).
        stages: ``None`` (plain modules) or a pipeline stage count dividing
            ``config.num_layers`` (an even split); then construct it inside ``with
            multi_mesh:`` (a ``("stage", "data", "model")`` MultiMesh,
            `models.pipeline.make_multimesh`).
        layers_per_stage: ``None`` or the blocks of every stage (e.g. ``(1, 3, 3, 1)``),
            adding up to ``config.num_layers``: an uneven split, instead of ``stages``
            (construct it inside ``with multi_mesh:`` likewise). Only the first stage (with
            the stem) and the last (with the head) may hold no block.
        rngs: NNX random streams (``params``; ``dropout`` for training with dropout).

    Raises:
        InvalidTaskError: ``stages`` does not divide the blocks, or ``layers_per_stage`` is
            not a split of them (see `models.pipeline.get_layers_per_stage`).

    Example:
        >>> from flax import nnx
        >>> from models import get_config
        >>> from models.llama_nnx import LlamaNNX
        >>> with nnx.use_eager_sharding(False):
        ...     model = LlamaNNX(get_config("llama-tiny"), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 8), jnp.int32)).shape
        (2, 8, 264)
        >>> model.blocks_1.attn.key.kernel.get_value().shape  # as in the Linen tree
        (64, 2, 16)

        Three blocks on stage 0 (with the stem), one on stage 1 (with the head):

        >>> from models.pipeline import make_multimesh
        >>> with make_multimesh(2, 2, 2):
        ...     staged = LlamaNNX(get_config("llama-tiny", num_layers=4),
        ...                       layers_per_stage=(3, 1), rngs=nnx.Rngs(0))
        >>> sorted(d.id for d in staged.blocks_3.mlp.up.kernel.get_value().devices())
        [4, 5, 6, 7]
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        stages: int | None = None,
        layers_per_stage: Sequence[int] | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        split = pipeline.get_layers_per_stage(config.num_layers, stages, layers_per_stage)
        staged = split is not None
        where = pipeline.block_stages(split) if staged else (0,) * config.num_layers
        last = len(split) - 1 if staged else 0
        self.num_layers = config.num_layers
        self.config = config
        self.stem = _on_stage(LlamaEmbedNNX, 0, staged)(config, rngs=rngs)
        for i, stage in enumerate(where):
            setattr(self, f"blocks_{i}", _on_stage(LlamaBlockNNX, stage, staged)(config, rngs=rngs))
        self.head = _on_stage(LlamaHeadNNX, last, staged)(config, rngs=rngs)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, *, deterministic: bool = True
    ) -> jax.Array:
        """Next-token logits ``(batch, length, vocab)`` for integer ``tokens``.

        Raises ``SequenceLengthError`` for ``tokens`` longer than ``config.max_len`` (or
        concrete ``positions`` reaching it).
        """
        check_length(self.config, tokens.shape, positions)
        positions = default_positions(tokens.shape, positions)
        x = self.stem(tokens)
        for i in range(self.num_layers):
            x = getattr(self, f"blocks_{i}")(x, positions, deterministic=deterministic)
        return self.head(x)


def load_linen_params(model: LlamaNNX, params: Any) -> None:
    """Writes the Linen `models.Llama` parameters ``params`` into ``model`` in place.

    ``params`` is the Linen tree (``init(...)["params"]``, boxed or not, or a restored
    checkpoint); every leaf goes to the NNX variable of the same path, keeping the
    variable's placement (a task's submesh) when it has one.

    Raises:
        ValueError: the trees differ (another architecture or config).
    """
    params = jax.tree_util.tree_map(
        lambda x: x.unbox() if hasattr(x, "unbox") else x,
        params,
        is_leaf=lambda x: hasattr(x, "unbox"),
    )
    state = nnx.state(model, nnx.Param)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, nnx.to_pure_dict(state))
    placed = jax.tree_util.tree_map(jax.device_put, params, shardings)
    state.replace_by_pure_dict(placed)
    nnx.update(model, state)
