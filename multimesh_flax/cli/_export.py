"""``mmflax export``: a run's latest checkpoint as a Hugging Face model folder.

The run's parameters are restored onto one device in the unstaged model's tree (the tree
does not depend on the pipeline layout the run trained with) and written by
`models.hf.save`: a GPT-2 (``GPT2LMHeadModel``) or Llama (``LlamaForCausalLM``) folder that
`transformers` and `models.hf.load` read. A run fine-tuned from a checkpoint with a
``tokenizer.json`` (``mmflax train --init-from``) gets that tokenizer in the folder too.
"""

from __future__ import annotations

from pathlib import Path

from models import hf
from multimesh_flax import errors
from multimesh_flax.cli import _recipe, _sample


def export(checkpoint: str | Path, to: str | Path) -> Path:
    """Writes the latest checkpoint of run folder `checkpoint` to the new folder `to`.

    Raises:
        PretrainedConfigError: `to` exists already (checked first).
        CheckpointNotFoundError: `checkpoint` holds no finished run.
    """
    target = Path(to)
    if target.exists() and (target.is_file() or any(target.iterdir())):
        raise errors.PretrainedConfigError(
            f"Expected `--to` to name a new folder, but '{target}' already exists. Choose "
            "another `--to`, or remove the folder first."
        )
    config, params, metadata = _sample.restore_params(checkpoint)
    tokenizer = _recipe.make_tokenizer(metadata["run"].get("init_from"))
    if not isinstance(tokenizer, hf.HFTokenizer):
        tokenizer = None
    return hf.save(to, config, params, tokenizer=tokenizer)
