"""Hugging Face checkpoints for the reference models: import, export, tokenizer.

* `load` reads a GPT-2 (``GPT2LMHeadModel``), Llama (``LlamaForCausalLM``, with Llama
  3.1's rope scaling or without), Mistral (``MistralForCausalLM``), Qwen2
  (``Qwen2ForCausalLM``) or Qwen3 (``Qwen3ForCausalLM``) folder -- ``config.json`` plus
  ``model.safetensors`` or sharded files with ``model.safetensors.index.json`` -- into a
  `models.ModelConfig` and the parameter tree of `models.GPT`/`models.Llama` (the same
  tree for every pipeline stage count). The last four are all `models.Llama`, with the
  config's ``rope_scaling``, ``qkv_bias``, ``qk_norm``, ``head_dim`` and ``sliding_window``.
* `load_placed` does the same but puts each tensor straight onto its stage's submesh of a
  ``MultiMesh``, in the sharding the pipelined model uses.
* `save` writes a config and parameters back in the same format (sharded above a size
  threshold), so a model fine-tuned here loads in ``transformers``; load -> save -> load is
  bit-exact.
* `load_config` reads only ``config.json``.
* `HFTokenizer` wraps a ``tokenizer.json`` (the `tokenizers` package) behind the interface of
  `models.ByteTokenizer`.

How tensors map: `models.hf._gpt2` and `models.hf._llama` (one `Rule` per tensor group,
`models.hf._layout`); files: `models.hf._files`; ``config.json``: `models.hf._config`, with
the rope settings in `models.hf._rope` and the explanation of a refused architecture in
`models.hf._refusals`.
"""

from ._load import load as load
from ._load import load_config as load_config
from ._load import load_placed as load_placed
from ._save import save as save
from ._tokenizer import HFTokenizer as HFTokenizer

__all__ = ["HFTokenizer", "load", "load_config", "load_placed", "save"]
