"""The settings of an ``mmflax train`` run: defaults, resuming, and checks before any work.

`TrainOptions` holds every setting (the fields are the ``mmflax train`` options). Settings
fall in three groups: `RUN_KEYS` define the run (model, data, optimizer, gradient
accumulation, precision) and a resumed run keeps them (a run saved before a setting existed
has its default); `LAYOUT_KEYS` define the parallel layout and recomputation, which a
resumed run may change (the parameter tree does not depend on them); `KEPT_KEYS`
(``eval_every``, ``tensorboard``) are kept unless given again; the rest (``steps``,
``out``, ...) are per invocation.

`resolve_options` fills what the user left unset -- with the defaults, or with ``resume``
with the settings saved in the run's checkpoint -- and `check_options` rejects
contradictions (an unknown preset, stages that do not divide the layers, a
``layers_per_stage`` that is not a split of them, a layout that does not cover the devices,
a batch that the microbatches and data replicas do not divide)
before anything is traced or compiled, raising `multimesh_flax.cli.errors.RunOptionError`.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import multimesh_flax as mm
from models import CORPUS_NAMES, PRESETS, ModelConfig
from multimesh_flax import errors
from multimesh_flax.checkpoint import Checkpointer, latest_step
from multimesh_flax.cli import _data, _optimizer, _recipe, _run_files, _sample, _saving
from multimesh_flax.cli._optimizer import OptimizerSettings
from multimesh_flax.cli.errors import RunOptionError

SCHEDULES = (
    "gpipe",
    "1f1b",
    "zero-bubble-h1",
    "zero-bubble-h2",
    "zero-bubble-auto",
    "zero-bubble-v",
)
V_SCHEDULES = ("zero-bubble-v",)
"""Schedules that put two stages on each submesh, on a V: ``--stages`` is twice the
submeshes."""
ON_NONFINITE = ("stop", "skip")
PRECISIONS = ("fp32", "bf16", "pure-bf16")
RECOMPUTE = ("none", "full", "dots")
RUN_KEYS = (
    "model",
    "layers",
    "batch_size",
    "seq_len",
    "lr",
    "warmup",
    "lr_schedule",
    "min_lr_ratio",
    "clip_norm",
    "grad_accum",
    "precision",
    "seed",
    "corpus",
    "init_from",
    "dataset",
    "text_field",
    "eval_fraction",
)
"""Settings that define a run: a resumed run keeps them."""
KEPT_KEYS = ("eval_every", "tensorboard")
"""Settings a resumed run keeps unless they are given again."""
LAYOUT_KEYS = (
    "stages",
    "layers_per_stage",
    "data",
    "tensor",
    "microbatches",
    "schedule",
    "recompute",
)
"""Settings of the parallel layout: a resumed run may change them."""
RUNS_DIR = Path("runs")
PRETRAINED = "pretrained"
"""The ``model`` of a run that starts from ``--init-from`` (a Hugging Face folder)."""


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """Every setting of a training run; the fields are the ``mmflax train`` options.

    Attributes:
        model: a preset of `models.PRESETS` (`PRETRAINED` with ``init_from``).
        layers: transformer blocks (``None``: the preset's count).
        stages, data, tensor: the layout: pipeline stages, each on ``data x tensor`` devices.
        layers_per_stage: the blocks of every stage (``None``: ``layers / stages`` each);
            ``stages`` is then its length. Part of the layout: a resumed run may change it.
        microbatches: microbatches per step; ``schedule``: their pipeline schedule.
        steps: optimizer steps this invocation runs (a resumed run runs that many more).
        batch_size, seq_len: windows per batch and tokens per window.
        lr, warmup: AdamW's rate, reached linearly over ``warmup`` steps.
        lr_schedule: after the warm-up, ``"constant"`` or ``"cosine"`` decay to
            ``min_lr_ratio * lr`` at the run's last step (`_optimizer`).
        clip_norm: the global gradient norm clipped to (0: no clipping).
        grad_accum: batches of ``batch_size`` rows whose gradients one update averages: a
            step's batch is that many consecutive batches, each cut into ``microbatches``
            microbatches (the step runs ``grad_accum x microbatches`` of them).
        precision: ``"fp32"``, ``"bf16"`` (bfloat16 compute, float32 parameters and
            optimizer state) or ``"pure-bf16"`` (bfloat16 state too), see
            ``parallelize_step``.
        recompute: ``"none"``, ``"full"`` or ``"dots"``: what the backward recomputes
            instead of keeping (``parallelize_step``'s ``recompute``).
        seed: seeds the parameters and the batch stream.
        corpus: one of `models.CORPUS_NAMES`, read as random windows (without ``dataset``).
        dataset: a ``.txt``, ``.jsonl`` or ``.parquet`` file or a folder of them to train on
            instead of ``corpus`` (`_data`); stored as an absolute path.
        text_field: the JSONL field or Parquet column holding a ``dataset``'s text.
        eval_fraction: the share of ``dataset``'s windows held out for evaluation (``None``:
            none); evaluated before the first step, every ``eval_every`` steps and at the end.
        eval_every: steps between evaluations (``None``: before and after training only).
        out: the run folder; ``resume`` continues the run saved there.
        check_reference: also train the unstaged model on one device and compare losses.
        log_every: steps between loss read-outs (the bar's postfix).
        progress: show the tqdm bar.
        init_from: a Hugging Face GPT-2/Llama/Qwen/Mistral folder (`models.hf`) to fine-tune
            instead of training ``model`` from scratch; its ``tokenizer.json``, if any, tokenizes.
        save_every: how often to save besides at the end: steps (``"50"``), a duration of
            training (``"5m"``) or ``"end"`` (`_saving.SaveEvery`).
        on_nonfinite: at a NaN or infinite loss or gradient norm, ``"stop"`` the run (the
            last finite state is saved) or ``"skip"`` that step's update and go on.
        tensorboard: also write TensorBoard event files under ``out/tensorboard/``.
        samples: generate text before and after training (``samples.txt``; greedy and
            sampled, up to ``seq_len`` tokens each: four generations, each compiled).
    """

    model: str = "gpt-tiny"
    layers: int | None = None
    stages: int = 2
    layers_per_stage: tuple[int, ...] | None = None
    data: int = 2
    tensor: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    steps: int = 400
    batch_size: int = 32
    seq_len: int = 64
    lr: float = 5e-3
    warmup: int = 30
    seed: int = 0
    corpus: str = "shakespeare_sonnets"
    out: str | None = None
    resume: bool = False
    check_reference: bool = False
    log_every: int = 10
    progress: bool = True
    init_from: str | None = None
    save_every: str = _saving.DEFAULT
    on_nonfinite: str = "stop"
    dataset: str | None = None
    text_field: str = "text"
    eval_fraction: float | None = None
    eval_every: int | None = None
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0
    grad_accum: int = 1
    precision: str = "fp32"
    recompute: str = "none"
    tensorboard: bool = False
    samples: bool = True

    @property
    def layout(self) -> str:
        """``stages x data x tensor``, e.g. ``"2x2x2"``."""
        return f"{self.stages}x{self.data}x{self.tensor}"

    @property
    def layout_description(self) -> str:
        """The layout for people: ``"2x2x2 (stages x data x tensor)"``, followed by the
        blocks of every stage when ``layers_per_stage`` is set."""
        text = f"{self.layout} (stages x data x tensor)"
        if self.schedule in V_SCHEDULES:
            text += f" on a V over {self.submeshes} submeshes"
        if self.layers_per_stage is None:
            return text
        return f"{text}, blocks per stage {','.join(map(str, self.layers_per_stage))}"

    @property
    def submeshes(self) -> int:
        """Submeshes along the pipeline: ``stages``, or half of them on a V schedule."""
        return self.stages // 2 if self.schedule in V_SCHEDULES else self.stages

    @property
    def stage_submeshes(self) -> tuple[int, ...] | None:
        """Each stage's submesh on a V schedule (stage s and 2R-1-s share one); else
        ``None``, stage s on submesh s."""
        if self.schedule not in V_SCHEDULES:
            return None
        return mm.core.declare.stage_rows(self.schedule, self.stages, self.submeshes)

    @property
    def rows_per_step(self) -> int:
        """Rows of a step's batch: ``grad_accum`` batches of ``batch_size``."""
        return self.batch_size * self.grad_accum

    @property
    def optimizer(self) -> OptimizerSettings:
        """The settings `_optimizer` builds the optimizer from."""
        return OptimizerSettings.of(dataclasses.asdict(self))


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _fail(message: str) -> RunOptionError:
    return RunOptionError(message)


def fresh_run_dir() -> str:
    """A new folder name under ``runs/``: the date and time, made unique with a suffix."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, count = RUNS_DIR / stamp, 1
    while path.exists():
        count += 1
        path = RUNS_DIR / f"{stamp}-{count}"
    return str(path)


def _resume_dir(out: str | None) -> Path:
    if out is not None:
        if (
            _run_files.read_settings(Path(out)) is not None
            and latest_step(Path(out) / _sample.CHECKPOINT_DIR) is None
        ):
            return Path(out)  # a run that was stopped before its first save finished
        return _sample.find_checkpoint(out).parent
    runs = sorted(RUNS_DIR.glob("*/" + _sample.CHECKPOINT_DIR), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise errors.CheckpointNotFoundError(
            f"`--resume` without `--out` continues the newest run in '{RUNS_DIR}/', but there "
            "is none. Pass `--out RUN_DIR` of the run to continue."
        )
    return _sample.find_checkpoint(runs[-1].parent).parent


def _saved_options(run_dir: Path) -> dict[str, Any]:
    """The saved run's settings and layout; ``steps``: what an interrupted run had left.

    They come from the latest checkpoint, or from the settings the run wrote when it
    started (`_run_files.read_settings`) when none of its saves finished.
    """
    checkpoint = run_dir / _sample.CHECKPOINT_DIR
    metadata = _run_files.read_settings(run_dir)
    if latest_step(checkpoint) is not None or metadata is None:
        checkpoint = _sample.find_checkpoint(run_dir)
        with Checkpointer(checkpoint, read_only=True) as ckpt:
            metadata = ckpt.metadata()
    try:
        saved = {**metadata["run"], **metadata["layout"], **metadata.get("kept", {})}
    except (KeyError, TypeError):
        raise errors.CheckpointMetadataError(
            f"The checkpoint in '{checkpoint}' has no `mmflax train` settings in its metadata "
            f"(found keys {sorted(metadata) if isinstance(metadata, dict) else metadata!r}); "
            "it was not written by `mmflax train`, or its metadata is damaged. Start a new run "
            "with another `--out`."
        ) from None
    left = metadata.get("target_step", 0) - metadata.get("step", 0)
    return {**saved, "steps": left} if left > 0 else saved


def resolve_options(given: Mapping[str, Any]) -> TrainOptions:
    """`TrainOptions` from the options a user set (``None`` values count as not set).

    Unset options take the defaults; with ``resume``, the saved run's settings and layout.

    Raises:
        CheckpointNotFoundError: ``resume`` without a checkpoint in ``out``.
        RunOptionError: ``resume`` with a run setting (`RUN_KEYS`) other than the saved one.
    """
    chosen = {key: value for key, value in given.items() if value is not None}
    if "init_from" in chosen and "model" in chosen:
        raise _fail(
            f"`--model` {chosen['model']!r} and `--init-from` {chosen['init_from']!r} both "
            "choose the model. Drop `--model` to fine-tune the checkpoint, or `--init-from` to "
            "train the preset from scratch."
        )
    _check_data_choice(chosen)
    if chosen.get("dataset") is not None:
        chosen["dataset"] = str(Path(chosen["dataset"]).absolute())
    if chosen.get("resume"):
        run_dir = _resume_dir(chosen.get("out"))
        saved = _saved_options(run_dir)
        if {"stages", "layers_per_stage"} & chosen.keys():  # a new split replaces the saved one
            saved = {k: v for k, v in saved.items() if k not in ("stages", "layers_per_stage")}
        defaults = TrainOptions()
        for key in RUN_KEYS:
            was = saved.get(key, getattr(defaults, key))  # older runs lack newer settings
            if key in chosen and chosen[key] != was:
                raise _fail(
                    f"`{_flag(key)}` {chosen[key]!r} differs from {was!r}, the value of "
                    f"the run in '{run_dir}'. A resumed run keeps its model, data and optimizer "
                    "settings; only the layout and `--steps` may change. Drop the option, or "
                    "start a new run in another `--out`."
                )
        chosen = {**saved, **chosen, "out": str(run_dir)}  # ``--steps`` beats what was left
    else:
        chosen.setdefault("out", fresh_run_dir())
    if chosen.get("init_from") is not None:
        chosen.setdefault("model", PRETRAINED)
    _resolve_split(chosen)
    options = TrainOptions(**chosen)
    if options.layers is None and options.model in PRESETS:
        options = dataclasses.replace(options, layers=PRESETS[options.model].num_layers)
    return options


def _resolve_split(chosen: dict[str, Any]) -> None:
    """``layers_per_stage`` as a tuple, and ``stages`` its length (an error if one disagrees)."""
    if chosen.get("layers_per_stage") is None:
        return
    split = tuple(chosen["layers_per_stage"])  # a list when read back from a checkpoint
    stages = chosen.get("stages", len(split))
    if stages != len(split):
        raise _fail(
            f"`--stages` {stages} and `--layers-per-stage` {','.join(map(str, split))} "
            f"({len(split)} stages) disagree. Drop `--stages`: the length of "
            "`--layers-per-stage` is the stage count."
        )
    chosen.update(layers_per_stage=split, stages=len(split))


def _check_data_choice(chosen: Mapping[str, Any]) -> None:
    if "dataset" in chosen and "corpus" in chosen:
        raise _fail(
            f"`--corpus` {chosen['corpus']!r} and `--dataset` {chosen['dataset']!r} both choose "
            "the training text. Drop one of them."
        )


def _check_ranges(options: TrainOptions) -> None:
    positive = ("layers", "stages", "data", "tensor", "microbatches", "steps", "batch_size")
    positive += ("grad_accum",)
    for key in (*positive, "seq_len", "log_every", "eval_every"):
        value = getattr(options, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise _fail(f"Expected `{_flag(key)}` to be a positive integer, got {value!r}.")
    if options.warmup < 0 or options.seed < 0:
        raise _fail(
            f"Expected `--warmup` and `--seed` >= 0, got {options.warmup} and {options.seed}."
        )
    if not (math.isfinite(options.lr) and options.lr > 0):
        raise _fail(f"Expected `--lr` to be a positive number, got {options.lr!r}.")
    if options.schedule not in SCHEDULES:
        raise _fail(f"Unknown `--schedule` {options.schedule!r}; choose one of {SCHEDULES}.")
    if options.on_nonfinite not in ON_NONFINITE:
        raise _fail(
            f"Unknown `--on-nonfinite` {options.on_nonfinite!r}; choose one of {ON_NONFINITE}."
        )
    _saving.SaveEvery.parse(options.save_every)
    if options.corpus not in CORPUS_NAMES:
        raise _fail(f"Unknown `--corpus` {options.corpus!r}; choose one of {CORPUS_NAMES}.")
    _check_evaluation(options)
    _check_recipe(options)


def _check_recipe(options: TrainOptions) -> None:
    """The optimizer, precision and recomputation settings."""
    _optimizer.check_settings(options.optimizer)
    if not options.resume:  # a resumed run's last step is known once its checkpoint is read
        _optimizer.check_schedule(options.optimizer, options.steps)
    for key, allowed in (("precision", PRECISIONS), ("recompute", RECOMPUTE)):
        if getattr(options, key) not in allowed:
            raise _fail(
                f"Unknown `{_flag(key)}` {getattr(options, key)!r}; choose one of {allowed}."
            )
    if options.check_reference and options.precision != "fp32":
        raise _fail(
            f"`--check-reference` holds the losses to {1e-4:.0e} of a float32 run on one device, "
            f"but `--precision` {options.precision!r} rounds to bfloat16 (about 4e-3). Check "
            "the layout with `--precision fp32`, or drop `--check-reference`."
        )


def _check_evaluation(options: TrainOptions) -> None:
    if options.eval_fraction is not None and options.dataset is None:
        raise _fail(
            f"`--eval-fraction` {options.eval_fraction} holds out part of a `--dataset`, but "
            "none was given (the shipped `--corpus` has no held-out split). Pass `--dataset "
            "PATH`, or drop `--eval-fraction`."
        )
    _data.check_eval_fraction(options.eval_fraction)
    if options.eval_every is not None and options.eval_fraction is None:
        raise _fail(
            f"`--eval-every` {options.eval_every} evaluates on held-out windows, but no "
            "`--eval-fraction` holds any out. Add e.g. `--eval-fraction 0.05`."
        )


def _check_model(options: TrainOptions) -> ModelConfig:
    if options.init_from is None and options.model not in PRESETS:
        raise _fail(
            f"Unknown `--model` preset {options.model!r}. Available presets: {', '.join(PRESETS)}."
        )
    config = _recipe.run_config(options.model, options.layers, options.init_from)
    if options.layers_per_stage is not None:
        _check_split(options, config)
    elif config.num_layers % options.stages:
        divisors = [d for d in range(1, config.num_layers + 1) if config.num_layers % d == 0]
        raise _fail(
            f"`--stages` {options.stages} does not divide the {config.num_layers} layers of "
            f"{options.model}: every stage needs the same number of blocks. Use one of "
            f"{divisors}, change the layer count with `--layers`, or split the layers "
            "unevenly with `--layers-per-stage`."
        )
    if options.seq_len > config.max_len:
        raise _fail(
            f"Expected `--seq-len` <= {config.max_len} (the longest sequence {options.model} "
            f"reads), got {options.seq_len}."
        )
    sizes = {"heads": config.num_heads, "key/value heads": config.num_kv_heads}
    sizes |= {"MLP width": config.mlp_dim, "vocabulary": config.vocab_size}
    uneven = {name: size for name, size in sizes.items() if size % options.tensor}
    if uneven:
        raise _fail(
            f"`--tensor` {options.tensor} does not divide the {uneven} of {options.model}, "
            "which tensor parallelism splits. Use a `--tensor` that divides them (1, 2, ...)."
        )
    return config


def _check_v(options: TrainOptions) -> None:
    if options.stages % 2 or options.stages < 2:
        raise _fail(
            f"`--schedule` {options.schedule} runs two stages per submesh, on a V; expected "
            f"an even `--stages`, got {options.stages}."
        )
    if options.init_from is not None:
        raise _fail(
            f"`--schedule` {options.schedule} does not load `--init-from` checkpoints yet "
            "(they are placed one stage per submesh). Use another schedule to fine-tune."
        )


def _check_split(options: TrainOptions, config: ModelConfig) -> None:
    """``--layers-per-stage`` against the model's layers (`models.pipeline`'s rules)."""
    assert options.layers_per_stage is not None
    split, layers = options.layers_per_stage, config.num_layers
    text = ",".join(map(str, split))
    if any(count < 0 for count in split) or sum(split) != layers:
        raise _fail(
            f"Expected `--layers-per-stage` to add up to the {layers} layers of "
            f"{options.model}, got {text} (adding up to {sum(split)}). Give every stage its "
            "blocks so that each layer has one, or change the layer count with `--layers`."
        )
    empty = [stage for stage in range(1, len(split) - 1) if split[stage] == 0]
    if empty:
        raise _fail(
            f"`--layers-per-stage` {text} leaves stage {empty[0]} without blocks; only the "
            "first stage (which holds the embedding) and the last (which holds the head) "
            "may hold none. Drop that stage or move a block onto it."
        )


def _check_layout(options: TrainOptions, device_count: int) -> None:
    if options.schedule in V_SCHEDULES:
        _check_v(options)
    used = options.submeshes * options.data * options.tensor
    if options.schedule in V_SCHEDULES and used != device_count:
        raise _fail(
            f"Expected `--stages` / 2 x `--data` x `--tensor` = {device_count} (the devices "
            f"available; `--schedule` {options.schedule} puts two stages on each submesh), "
            f"got {options.stages} / 2 x {options.data} x {options.tensor} = {used}."
        )
    if used != device_count:
        raise _fail(
            f"Expected `--stages` x `--data` x `--tensor` = {device_count} (the devices "
            f"available), got {options.stages} x {options.data} x {options.tensor} = {used}. "
            "Change the three so their product is the device count, or the device count "
            "with `--devices`."
        )
    share = options.microbatches * options.data
    if options.batch_size % share:
        raise _fail(
            f"Expected `--batch-size` to be a multiple of `--microbatches` x `--data` = "
            f"{options.microbatches} x {options.data} = {share} (each microbatch splits over "
            f"the data replicas), got {options.batch_size}. Use e.g. `--batch-size "
            f"{share * max(1, round(options.batch_size / share))}`."
        )


def _check_run_dir(options: TrainOptions) -> None:
    if options.resume or options.out is None:
        return
    if Path(options.out).exists() and not Path(options.out).is_dir():
        raise _fail(
            f"Expected `--out` to be a run folder (new or empty), got '{options.out}', which is "
            "an existing file. Choose another `--out` path, or move the file away."
        )
    if latest_step(Path(options.out) / _sample.CHECKPOINT_DIR) is not None:
        raise _fail(
            f"`--out` '{options.out}' already holds a run. Pass `--resume` to continue it, or "
            "choose another `--out`."
        )


def check_options(options: TrainOptions, device_count: int) -> ModelConfig:
    """Checks ``options`` against the model and ``device_count`` devices; returns the config.

    Nothing is traced or compiled.

    Raises:
        RunOptionError: the first contradiction found (see the class).
    """
    _check_ranges(options)
    config = _check_model(options)
    _check_layout(options, device_count)
    _check_run_dir(options)
    return _recipe.compute_config(config, options.precision)
