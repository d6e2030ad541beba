"""The ``mmflax`` command-line application, built on the library but not part of it.

Nothing in `multimesh_flax` imports this package; it uses the public library (``mm.*``,
``multimesh_flax.checkpoint``) and the reference models in `models`. Its modules:

* `_cli`: the entry point (`main`): parses ``mmflax demo | train | sample | export``, sets up
  the devices, prints results, and turns errors into ``mmflax: <message>`` with status 2.
* `_train`: ``mmflax train``: trains a `models` preset pipelined over a ``MultiMesh``,
  checks it against the unstaged model when asked, saves checkpoints.
* `_sample`: ``mmflax sample`` and train's before/after samples: restores a run's
  parameters onto one device and generates text.
* `_export`: ``mmflax export``: a run's checkpoint as a Hugging Face model folder.
* `_demo`: ``mmflax demo``: a two-layer function placed on two submeshes.
* `_run_options`: the settings of a run (`TrainOptions`): defaults, resuming, checks
  before any work.
* `_recipe`: what a run is made of: model, optimizer, loss, tokenizer and batches.
* `_data`: batches of ``--dataset`` (packed windows, held-out split, a grain stream), over
  `_text_files` (reading ``.txt``/``.jsonl``/``.parquet``) and `_token_cache` (tokens in a
  memory-mapped file); `_evaluation`: the held-out loss.
* `_run_files`: the run folder's files besides the checkpoint (``metrics.json``,
  ``loss.png``, ``samples.txt``).
* `errors`: the errors only the application raises (`RunOptionError`, `DataFileError`, ...).

``python -m multimesh_flax.cli`` is the same as the ``mmflax`` script.
"""

from multimesh_flax.cli._cli import main

__all__ = ["main"]
