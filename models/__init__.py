"""Reference decoder-only transformers in plain Flax Linen, with logical axis annotations.

Two families share one `ModelConfig` (pick a preset with `get_config` or build one):

* `GPT` (`models.gpt`): GPT-2 style, learned positions, LayerNorm, GELU, tied embeddings.
* `Llama` (`models.llama`): RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Each model is a named sequence of stages -- an embedding stem, ``blocks_0`` ...
``blocks_{L-1}``, and a head -- and each stage is also exported as its own module
(`GPTEmbed`/`GPTBlock`/`GPTHead`, `LlamaEmbed`/`LlamaBlock`/`LlamaHead`) whose parameters are a
sub-tree of the full model's, so a pipeline can run them one by one. Every parameter and
activation carries logical axis names (``batch``, ``length``, ``embed``, ``mlp``, ``heads``,
``kv_heads``, ``head_dim``, ``vocab``); they shard under `flax.linen.logical_axis_rules`.

Around the models: `generate` (KV-cached decoding), `cross_entropy_loss`, and in
`models.data` a byte-level tokenizer, a seeded batcher and a small public-domain corpus.
"""

from ._factory import make_model as make_model
from .configs import PRESETS as PRESETS
from .configs import Family as Family
from .configs import ModelConfig as ModelConfig
from .configs import get_config as get_config
from .data import CORPUS_NAMES as CORPUS_NAMES
from .data import ByteTokenizer as ByteTokenizer
from .data import iterate_batches as iterate_batches
from .data import load_corpus as load_corpus
from .generate import generate as generate
from .generate import init_cache as init_cache
from .gpt import GPT as GPT
from .gpt import GPTBlock as GPTBlock
from .gpt import GPTEmbed as GPTEmbed
from .gpt import GPTHead as GPTHead
from .llama import Llama as Llama
from .llama import LlamaBlock as LlamaBlock
from .llama import LlamaEmbed as LlamaEmbed
from .llama import LlamaHead as LlamaHead
from .loss import cross_entropy_loss as cross_entropy_loss

__all__ = [
    "CORPUS_NAMES",
    "GPT",
    "PRESETS",
    "ByteTokenizer",
    "Family",
    "GPTBlock",
    "GPTEmbed",
    "GPTHead",
    "Llama",
    "LlamaBlock",
    "LlamaEmbed",
    "LlamaHead",
    "ModelConfig",
    "cross_entropy_loss",
    "generate",
    "get_config",
    "init_cache",
    "iterate_batches",
    "load_corpus",
    "make_model",
]
