"""Training runs behind ``mmflax train``: a reference model, pipelined, trained on a corpus.

A run trains a preset of `models` (``gpt-tiny`` by default) cut into ``stages`` pipeline
stages (evenly, or ``layers_per_stage`` blocks on each), each on a ``data x tensor`` submesh
of a ``MultiMesh`` (`models.pipeline`), with ``microbatches`` microbatches per step under a
pipeline ``schedule``. The settings come from
`_run_options`; the step from ``parallelize_step`` (with the run's ``precision`` and
``recompute``); model, loss and batches from `_recipe`; the optimizer and its learning-rate
schedule, which ends at the step the invocation is going to, from `_optimizer`.

``--grad-accum K`` feeds each step K consecutive batches as one batch of K times the rows,
cut into K x ``microbatches`` microbatches: the step averages their gradients (as it
averages any microbatches') and applies one update. So ``--steps`` counts updates, a
checkpoint always falls between updates (the stream's state included), and the non-finite
check and the gradient norm are those of the accumulated gradient. With ``--tensorboard``
a `_tensorboard.TrainLog` writes every step's scalars and every evaluation.

`train` prints nothing: it reports through a callback (default: this module's logger) and
shows a tqdm bar. It locks the run folder (`_run_lock`); trains, blocking on every step and
reading its loss back (the first NaN or infinity stops the run at its step); saves an orbax
checkpoint when ``save_every`` says (`_saving`) and at the end, never a state with a
non-finite leaf; records one step's pipeline timeline after warm-up; checks the losses
against the unstaged model on one device when asked (`reference_losses`); and writes the run
folder (`_run_files`). SIGINT and SIGTERM (`_interrupts`) end the loop after the step in
flight, which is saved.

``--check-reference`` trains the unstaged model on one device from the same initial state on
the same batches; the first `REFERENCE_STEPS` losses must agree to `REFERENCE_TOLERANCE`
(relative), later ones are reported (they drift apart with float rounding, see there).

Resuming restores the latest checkpoint onto the new layout -- the parameter tree does not
depend on it -- and continues the same batch stream and learning-rate schedule, so N steps
plus N resumed steps give the losses of 2N uninterrupted ones (bit for bit on one layout).
A checkpoint records the step its invocation was going to (``target_step``): ``--resume``
after an interruption runs the steps left.

Without ``--dataset`` a run draws random windows of the shipped ``--corpus``
(`_recipe.batch_stream`). With it, batches come from `_data` (packed windows of the user's
files, a grain stream whose iterator state every checkpoint records and ``--resume``
restores), and with ``--eval-fraction`` an `_evaluation.Evaluator` measures the held-out
loss before the first step, every ``--eval-every`` steps and after the last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import multimesh_flax as mm
from models import ModelConfig, load_corpus
from models.pipeline import make_multimesh
from multimesh_flax import errors
from multimesh_flax._compilation_cache import compilation_counter
from multimesh_flax.checkpoint import Checkpointer
from multimesh_flax.cli import _data, _evaluation, _optimizer, _recipe, _run_files, _sample
from multimesh_flax.cli._interrupts import StopRequests, agreed
from multimesh_flax.cli._nonfinite import Skipped, SkipWatch
from multimesh_flax.cli._run_lock import RunLock
from multimesh_flax.cli._run_options import (
    KEPT_KEYS,
    LAYOUT_KEYS,
    RUN_KEYS,
    TrainOptions,
    check_options,
    fresh_run_dir,
)
from multimesh_flax.cli._saving import SaveEvery, Saver
from multimesh_flax.cli._tensorboard import TrainLog
from multimesh_flax.cli.errors import NonFiniteTrainingError
from multimesh_flax.distributed import host_values

logger = logging.getLogger(__name__)

Report = Callable[[str], None]

REFERENCE_TOLERANCE = 1e-4
"""Largest relative loss difference ``--check-reference`` accepts."""
REFERENCE_STEPS = 20
"""Steps over which ``--check-reference`` holds the losses to `REFERENCE_TOLERANCE`.

Two correct trainings that differ only in float rounding (the pipelined sums run in another
order) drift apart: Adam turns rounding differences into different updates, and the gap
grows -- for the default run from 1e-6 in the first steps to ~1e-2 by step 400, as large as
perturbing the initial parameters by 1e-7. So the first steps are compared strictly and the
rest only reported.
"""
_SAMPLE_KINDS = {"greedy": 0.0, "sampled (temperature 0.8)": 0.8}


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What `train` did: the run folder, this invocation's steps and its measurements."""

    run_dir: Path
    start_step: int
    end_step: int
    losses: list[float]
    tokens_per_s: float
    wall_s: float
    metrics: dict[str, Any]
    stopped_by: str | None = None
    saved_step: int | None = None


@dataclasses.dataclass
class _Steps:
    """What the training loop leaves behind."""

    state: Any
    history: dict[str, list[float]]
    timeline: Any = None
    recorded_step: int | None = None
    compile_s: float = 0.0
    compilation: dict[str, float] = dataclasses.field(default_factory=dict)
    batches: list[Any] = dataclasses.field(default_factory=list)
    last_batch: Any = None
    stopped_by: str | None = None  # the signal that ended the loop early, e.g. "SIGTERM"
    nonfinite: str | None = None  # what was NaN or infinite, where, if that ended the loop
    skipped: list[int] = dataclasses.field(default_factory=list)  # steps not applied
    evals: dict[str, list[float]] = dataclasses.field(default_factory=_run_files.empty_evals)
    shown_rate: float | None = None  # the tokens/s the progress bar shows

    @property
    def count(self) -> int:
        """Steps run."""
        return len(self.history["step"])


@dataclasses.dataclass
class _Built:
    """The compiled step of a run and what it was built from."""

    step_fn: Any
    state: Any
    placement: Any
    model: Any
    multi: mm.MultiMesh
    rate: Any  # the learning-rate schedule


@dataclasses.dataclass
class _Feed:
    """Where a run's batches come from: the stream, its data and how batches are placed."""

    stream: Any  # an iterator of batches; with ``--dataset`` a `_data.BatchStream`
    data: _data.TextData | None = None
    cache_key: str | None = None
    place: Callable[[Any], Any] = lambda batch: batch  # one process: the step places them

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint records of the stream (``None`` for the shipped corpus)."""
        if self.data is None:
            return None
        return {"iterator": self.stream.get_state(), "cache_key": self.cache_key}


def _build(options: TrainOptions, config: ModelConfig, horizon: int) -> _Built:
    """The step, state and placement for the layout in ``options``; ``horizon``: the step
    the run is going to (where ``--lr-schedule cosine`` ends).

    With ``--grad-accum`` K the step takes K batches as one of K times the rows, cut into
    K times ``--microbatches`` microbatches whose gradients it averages before the update.
    """
    multi = make_multimesh(options.submeshes, options.data, options.tensor)
    model = _recipe.make_model(
        config, options.stages, options.layers_per_stage, options.stage_submeshes
    )
    example = _recipe.example_batch(options.rows_per_step, options.seq_len)
    rng = jax.random.key(options.seed)
    rate = _optimizer.make_schedule(options.optimizer, horizon)
    with mm.context(strict=True):  # our own job: a PlacementWarning is an error
        with multi:
            placement = mm.layers.get_placement(model, rng, example["inputs"])
        built = mm.parallelize_step(
            model,
            _optimizer.make_optimizer(options.optimizer, horizon),
            multi,
            example,
            loss_fn=_recipe.lm_loss,
            rng=rng,
            microbatches=options.microbatches * options.grad_accum,
            schedule=options.schedule,
            nonfinite="skip",  # never a non-finite state; _nonfinite.SkipWatch reports it
            precision=options.precision,
            recompute=options.recompute,
        )
    step_fn, state = built.step, built.state
    if options.init_from is not None and not options.resume:
        state = state.replace(params=_pretrained_params(options, multi))
    return _Built(step_fn, state, placement, model, multi, rate)


def _pretrained_params(options: TrainOptions, multi: mm.MultiMesh) -> Any:
    """The ``--init-from`` checkpoint's parameters, each tensor placed on its stage."""
    from models import hf

    assert options.init_from is not None
    dtype = jnp.bfloat16 if options.precision == "pure-bf16" else np.float32  # as the state
    _, params = hf.load_placed(
        options.init_from,
        multi,
        stages=options.stages,
        layers_per_stage=options.layers_per_stage,
        dtype=dtype,
    )
    return params


def _run_steps(
    step_fn: Any,
    state: Any,
    options: TrainOptions,
    start: int,
    saver: Saver,
    stop: Any,
    feed: _Feed,
    evaluate: _evaluation.Evaluator | None = None,
    log: TrainLog | None = None,
) -> _Steps:
    """Trains up to ``options.steps`` steps from global step ``start``, blocking on each.

    Every loss is read back as it is produced (the loop blocks on each step anyway). A step
    whose loss or gradient norm is not finite is not applied (the step is built with
    ``nonfinite="skip"``); `SkipWatch` finds it, and ``--on-nonfinite stop`` ends the loop
    there. Between steps the loop saves when ``saver`` says a save is due, and ends early
    once ``stop`` (a `StopRequests`) has caught SIGINT or SIGTERM. A batch is drawn from
    ``feed`` only for a step that runs, so the stream's state always matches the steps.
    With ``evaluate``, the held-out loss is measured before the first step, every
    ``eval_every`` steps and after the last. ``log`` (`TrainLog`) gets every step's
    scalars and every evaluation.
    """
    out = _Steps(state, _run_files.empty_history())
    watch = SkipWatch(step_fn)
    record_at = min(2, options.steps - 1)  # one step after warm-up
    per_step = options.rows_per_step * options.seq_len
    with tqdm(total=options.steps, desc="train", unit="step", disable=not options.progress) as bar:
        _evaluate(evaluate, out, start, bar, log)
        for i in range(options.steps):
            if agreed(stop.signal is not None):
                out.stopped_by = stop.signal_name
                break
            batch = next(feed.stream)
            loss = _one_step(step_fn, out, feed.place(batch), start + i + 1, i == record_at)
            out.history["loss"].append(float(host_values(loss)))  # every process
            if _skipped(out, watch.after(start + i + 1, out.history["loss"][-1]), options, bar):
                break
            if log is not None:
                last = {key: out.history[key][-1] for key in ("loss", "tokens_per_s")}
                log.step(start + i + 1, **last, skipped=len(out.skipped), check=step_fn.last_check)
            if options.check_reference:
                out.batches.append(batch)
            if options.eval_every and (start + i + 1) % options.eval_every == 0:
                _evaluate(evaluate, out, start + i + 1, bar, log)
            if (i + 1) % options.log_every == 0 or i + 1 == options.steps:
                _show(bar, out, options.log_every, per_step)
            bar.update()
            if i + 1 < options.steps and saver.due(start + i + 1):
                out.nonfinite = saver.save(start + i + 1, out.state)
                if out.nonfinite is not None:
                    break
        if out.nonfinite is None:
            _skipped(out, watch.finish(), options, bar)
        if out.nonfinite is None and out.stopped_by is None:
            _evaluate(evaluate, out, start + out.count, bar, log)
    if out.count:
        out.compile_s = out.history["step_time_s"][0]
    return out


def _skipped(out: _Steps, found: Skipped | None, options: TrainOptions, bar: Any) -> bool:
    """Records a step whose update was not applied; whether the loop must stop for it."""
    if found is None:
        return False
    out.skipped.append(found.step)
    if options.on_nonfinite == "stop":
        out.nonfinite = found.message
        return True
    bar.write(f"{found.message} (--on-nonfinite skip)", file=sys.stderr)
    return False


def _one_step(step_fn: Any, out: _Steps, batch: Any, step: int, record: bool) -> jax.Array:
    """Runs step ``step`` (recording its timeline if asked), times it; returns the loss."""
    recording = mm.record_timeline() if record else contextlib.nullcontext()
    began = time.perf_counter()
    with recording as timeline:
        loss, out.state = step_fn(out.state, batch)
        loss.block_until_ready()  # queued multi-device calls can deadlock on CPU
        if jax.process_count() > 1:  # ... and so can host collectives behind a step's tail
            jax.block_until_ready(out.state)
    elapsed = time.perf_counter() - began
    if record:
        out.timeline, out.recorded_step = timeline, step
    out.last_batch = batch
    out.history["step"].append(step)
    out.history["step_time_s"].append(elapsed)
    out.history["tokens_per_s"].append(batch["inputs"].size / elapsed)
    return loss


def _evaluate(evaluate: Any, out: _Steps, step: int, bar: Any, log: TrainLog | None) -> None:
    """Measures the held-out loss at ``step`` (once per step), shows and logs it."""
    if evaluate is None or step in out.evals["step"]:
        return
    loss, perplexity = evaluate(out.state.params)
    for key, value in zip(_run_files.EVAL_KEYS, (step, loss, perplexity), strict=True):
        out.evals[key].append(value)
    if log is not None:
        log.evaluation(step, loss, perplexity)
    bar.set_postfix(_postfix(out, out.shown_rate), refresh=False)


def _postfix(out: _Steps, tokens_per_s: float | None = None) -> dict[str, str]:
    """The bar's postfix: the latest loss, tokens/s and held-out loss and perplexity."""
    shown = {}
    if out.history["loss"]:
        shown["loss"] = f"{out.history['loss'][-1]:.3f}"
    if tokens_per_s is not None:
        shown["tok_s"] = f"{tokens_per_s:,.0f}"
    if out.evals["loss"]:
        shown["eval_loss"] = f"{out.evals['loss'][-1]:.3f}"
        shown["eval_ppl"] = f"{out.evals['perplexity'][-1]:.2f}"
    return shown


def _show(bar: Any, out: _Steps, window: int, tokens: int) -> None:
    """Shows the latest loss, the recent tokens/s and the latest evaluation on the bar."""
    out.shown_rate = tokens / statistics.median(out.history["step_time_s"][-window:])
    bar.set_postfix(_postfix(out, out.shown_rate))


def _steady_tokens_per_s(steps: _Steps, start: int, tokens: int) -> float:
    """Median tokens/s over the steps that neither compiled nor recorded a timeline."""
    skip = {start + 1, steps.recorded_step}
    times = [
        t
        for s, t in zip(steps.history["step"], steps.history["step_time_s"], strict=True)
        if s not in skip
    ]
    times = times or steps.history["step_time_s"]
    return tokens / statistics.median(times)


def _on_one_device(tree: Any) -> Any:
    return jax.device_put(host_values(tree), jax.local_devices()[0])


def reference_losses(config: ModelConfig, host_state: Any, batches: list[Any]) -> list[float]:
    """The losses of the unstaged model trained from ``host_state`` under ``jax.jit``.

    One device, no tasks, no microbatches: the reference the pipelined run must match.
    """
    model = _recipe.make_model(config)

    @jax.jit
    def step(state: Any, batch: Any) -> tuple[jax.Array, Any]:
        def loss(params: Any) -> jax.Array:
            apply: Any = lambda x: model.apply({"params": params}, x)
            return _recipe.lm_loss(apply, batch)

        value, grads = jax.value_and_grad(loss)(state.params)
        return value, state.apply_gradients(grads=grads)

    state, losses = _on_one_device(host_state), []
    for batch in batches:
        value, state = step(state, batch)
        losses.append(float(value))
    return losses


def _compare(losses: list[float], reference: list[float]) -> dict[str, Any]:
    """Relative loss differences: checked over the first `REFERENCE_STEPS`, reported over all."""
    got, want = np.asarray(losses), np.asarray(reference)
    diff = np.abs(got - want)
    relative = diff / np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    checked = min(REFERENCE_STEPS, len(want))
    return {
        "checked_steps": checked,
        "max_abs_diff": float(diff[:checked].max()),
        "max_rel_diff": float(relative[:checked].max()),
        "tolerance": REFERENCE_TOLERANCE,
        "max_rel_diff_all_steps": float(relative.max()),
        "last_10_mean_loss": float(want[-10:].mean()),
        "losses": reference,
    }


def _samples(
    config: ModelConfig, params: Any, options: TrainOptions, data: _data.TextData | None
) -> dict[str, Any]:
    """Text generated from ``params``, and how much of it the training text contains."""
    model = _recipe.make_model(config)
    params = _on_one_device(params)
    prompt = _sample.DEFAULT_PROMPT
    tokenizer = _recipe.make_tokenizer(options.init_from)
    count = _sample.default_tokens(prompt, options.seq_len, tokenizer)
    corpus = load_corpus(options.corpus) if data is None else data.head_text(tokenizer)
    texts = {
        kind: _sample.generate_text(
            model, params, prompt, count, temperature=t, seed=0, tokenizer=tokenizer
        )
        for kind, t in _SAMPLE_KINDS.items()
    }
    rates = {kind: _sample.corpus_match_rate(t[len(prompt) :], corpus) for kind, t in texts.items()}
    return {"texts": texts, "corpus_match_rate": rates}


def _timeline(steps: _Steps, step_fn: Any, path: Path) -> dict[str, Any] | None:
    """Plots the recorded step next to the simulator's prediction; returns the bubbles."""
    if steps.timeline is None or not steps.timeline.events:
        return None
    schedule = step_fn.executable(steps.state, steps.last_batch).schedule
    costs = mm.measured_costs(steps.timeline)
    mm.plot_timeline(steps.timeline, schedule=schedule, path=str(path), costs=costs)
    try:
        recorded: float | None = mm.recorded_bubble(steps.timeline)
    except errors.TimelineDataError:
        recorded = None
    simulated = unit = overlapped = peaks = None
    if schedule is not None:
        predicted = mm.simulate(schedule, costs=costs)
        simulated, overlapped = predicted.bubble_fraction, predicted.steady_bubble_fraction
        peaks = list(predicted.peak_in_flight)
        unit = mm.simulate(schedule).bubble_fraction
    return {
        "step": steps.recorded_step,
        "recorded": recorded,
        "simulated": simulated,
        "simulated_unit_costs": unit,
        "simulated_overlapped_steps": overlapped,
        "peak_activation_sets": peaks,
        "measured_costs_s": costs,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    try:
        return np.dtype(value).name
    except TypeError:
        return str(value)


def _metadata(
    options: TrainOptions,
    config: ModelConfig,
    step: int,
    target_step: int,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a checkpoint records besides the state; ``target_step`` is where this invocation
    was going, so that ``--resume`` after an interruption finishes it; ``data``: the state
    of a ``--dataset`` stream after ``step`` (`_Feed.state`)."""
    metadata = {
        "run": {key: getattr(options, key) for key in RUN_KEYS},
        "layout": {key: getattr(options, key) for key in LAYOUT_KEYS},
        "kept": {key: getattr(options, key) for key in KEPT_KEYS},
        "step": step,
        "target_step": target_step,
        "config": {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)},
    }
    if data is not None:
        metadata["data"] = data
    return metadata


def train(options: TrainOptions, report: Report = logger.info) -> TrainResult:
    """Trains as ``options`` say and writes the run folder; see the module docstring.

    The run folder is locked while this runs (`RunLock`). SIGINT and SIGTERM end training
    after the step in flight; the state is saved and the result says which signal
    (``TrainResult.stopped_by``).

    Args:
        options: resolved options (see `resolve_options`).
        report: receives the placement table and progress notes (the CLI prints them).

    Returns:
        A `TrainResult`; ``metrics`` is what ``metrics.json`` holds.

    Raises:
        RunOptionError: ``options`` contradict the model or the devices (`check_options`).
        RunFolderBusyError: another process is writing ``options.out``.
        NonFiniteTrainingError: a loss (or, at a save, a parameter) became NaN or infinite;
            ``metrics.json`` is written up to that step and nothing non-finite is saved.
    """
    began = time.perf_counter()
    config = check_options(options, jax.device_count())
    run_dir = Path(options.out or fresh_run_dir()).absolute()  # orbax needs absolute paths
    prepared = _prepare_data(options, run_dir, report)  # bad files fail here, leaving nothing
    lock = RunLock(run_dir) if jax.process_index() == 0 else contextlib.nullcontext()
    with lock, StopRequests() as stop:
        return _train_in(run_dir, options, config, report, stop, began, prepared)


def _prepare_data(options: TrainOptions, run_dir: Path, report: Report) -> Any:
    """``(TextData, Tokens)`` of ``--dataset`` (tokens cached in the run folder), or ``None``."""
    if options.dataset is None:
        return None
    data, tokens = _data.prepare_dataset(
        options.dataset,
        _recipe.make_tokenizer(options.init_from),
        text_field=options.text_field,
        seq_len=options.seq_len,
        batch_size=options.batch_size,
        eval_fraction=options.eval_fraction,
        run_dir=run_dir,
    )
    how = "tokenized into" if tokens.rebuilt else "reusing the tokens cached in"
    report(
        f"dataset {options.dataset}: {tokens.documents} documents, {tokens.ids.size} tokens "
        f"({how} {tokens.folder}); {data.train_count} training and {data.held_out_count} "
        f"held-out windows of {options.seq_len + 1} tokens, {data.tail_tokens} tokens left over"
    )
    return data, tokens


def _train_in(
    run_dir: Path,
    options: TrainOptions,
    config: ModelConfig,
    report: Report,
    stop: StopRequests,
    began: float,
    prepared: Any,
) -> TrainResult:
    """`train` with the run folder locked and signals caught."""
    compiled = compilation_counter()
    with Checkpointer(run_dir / _sample.CHECKPOINT_DIR, max_to_keep=2) as ckpt:
        start = _start_step(ckpt, options, run_dir, report)
        target = start + options.steps
        _optimizer.check_schedule(options.optimizer, target)
        built = _build(options, config, target)
        step_fn, placement = built.step_fn, built.placement
        report(str(placement))
        state = _restore(ckpt, built.state, start, options, run_dir, report)
        feed = _make_feed(options, built, prepared, start, ckpt, report)
        data = feed.data
        if jax.process_index() == 0:
            _run_files.write_settings(run_dir, _metadata(options, config, start, target))
        every = SaveEvery.parse(options.save_every)
        saver = Saver(ckpt, every, lambda s: _metadata(options, config, s, target, feed.state()))
        host_start = host_values(state) if options.check_reference else None
        before = _samples(config, state.params, options, data) if options.samples else None
        evaluate = None
        if data is not None and options.eval_fraction is not None:
            batches = data.eval_batches(options.batch_size)
            evaluate = _evaluation.Evaluator(built.model, built.multi, batches)
        log = TrainLog(run_dir, start, built.rate, options.tensorboard)
        try:
            steps = _run_steps(step_fn, state, options, start, saver, stop, feed, evaluate, log)
        finally:
            log.close()
        steps.compilation = compiled()  # building and training; sampling compiles more
        if steps.count:  # never a non-finite state: `save` refuses it
            problem = saver.save(start + steps.count, steps.state)
            steps.nonfinite = steps.nonfinite or problem
        finished = steps.nonfinite is None and steps.stopped_by is None
        sample_after = finished and options.samples
        after = _samples(config, steps.state.params, options, data) if sample_after else None
        reference = None
        if host_start is not None and finished:
            ref = reference_losses(config, host_start, steps.batches)
            reference = _compare(steps.history["loss"], ref)
    bubble = _timeline(steps, step_fn, run_dir / _run_files.TIMELINE_PNG)
    metrics = _finish(options, run_dir, steps, start, placement, bubble, reference, before, after)
    metrics["summary"]["wall_s"] = time.perf_counter() - began
    if data is not None:
        metrics["data"] = {"cache_key": feed.cache_key, **data.describe()}
        metrics["summary"]["eval_programs"] = evaluate.programs if evaluate else None
    if jax.process_index() == 0:  # in a multi-process job, process 0 writes the run folder
        _run_files.write_metrics(run_dir, metrics)
    if steps.nonfinite is not None:
        raise NonFiniteTrainingError(
            f"{steps.nonfinite}. Training stopped after step {start + steps.count}; "
            f"{saver.kept()} (a state holding a NaN or an infinity is never saved). Lower "
            "`--lr` or raise `--warmup` in a new run, check the data, or pass "
            "`--on-nonfinite skip` to skip such steps."
        )
    return TrainResult(
        run_dir=run_dir,
        start_step=start,
        end_step=start + steps.count,
        losses=steps.history["loss"],
        tokens_per_s=metrics["summary"]["tokens_per_s"],
        wall_s=metrics["summary"]["wall_s"],
        metrics=metrics,
        stopped_by=steps.stopped_by,
        saved_step=saver.last_step,
    )


def _make_feed(
    options: TrainOptions,
    built: _Built,
    prepared: Any,
    start: int,
    ckpt: Checkpointer,
    report: Report,
) -> _Feed:
    """The batches from step ``start`` on: the shipped corpus, or the ``--dataset`` stream
    moved to the state the checkpoint of step ``start`` recorded.

    In a multi-process job each process reads only the rows its devices hold (`_data`).

    Raises:
        CheckpointMetadataError: the checkpoint of a ``--dataset`` run lacks the stream's state.
    """
    batch, seq = options.rows_per_step, options.seq_len
    if prepared is None:
        tokens = _recipe.corpus_tokens(options.corpus, _recipe.make_tokenizer(options.init_from))
        stream = _recipe.batch_stream(
            tokens, options.batch_size, seq, options.seed, start, options.grad_accum
        )
        return _Feed(stream)
    data, tokens = prepared
    feed = _Feed(None, data, tokens.key)
    rows = None
    if jax.process_count() > 1:
        with built.multi:
            example = _recipe.example_batch(batch, seq)
            (_, shardings), _ = built.step_fn.jitted.input_shardings(built.state, example)
        rows = _data.rows_of_process(list(shardings.values()), (batch, seq), jax.process_index())
        feed.place = functools.partial(_data.place_batch, shardings=shardings)
    feed.stream = data.train_stream(batch, options.seed, rows)  # K batches: K times the rows
    if start > 0:
        saved = ckpt.metadata(start).get("data")
        if saved is None:
            raise errors.CheckpointMetadataError(
                f"The checkpoint of step {start} in '{ckpt.directory}' records no `--dataset` "
                "stream state, so the run cannot continue its batches. Start a new run with "
                "another `--out`."
            )
        if saved["cache_key"] != tokens.key:
            report(
                f"the `--dataset` files changed since step {start} was saved: continuing the "
                "stream's position over the new tokens"
            )
        feed.stream.set_state(saved["iterator"])
    return feed


def _start_step(ckpt: Checkpointer, options: TrainOptions, run_dir: Path, report: Report) -> int:
    """The step the run starts after: with ``resume``, its latest checkpoint's, else 0.

    The step is the checkpoint's number, the steps the run went through; ``state.step``
    counts the updates applied, fewer when ``--on-nonfinite skip`` skipped some. A resumed
    run whose every save was interrupted (nothing finalized) starts at step 0.
    """
    latest = ckpt.latest_step() if options.resume else 0
    if latest is None:
        report(
            f"'{run_dir}' holds no finished checkpoint (its saves were interrupted): "
            "starting from step 0"
        )
    return latest or 0


def _restore(
    ckpt: Checkpointer, state: Any, start: int, options: TrainOptions, run_dir: Path, report: Report
) -> Any:
    """The state of checkpoint ``start`` onto ``state``'s layout (``state`` itself at 0)."""
    if start == 0:
        return state
    state = ckpt.restore(start, target=state)
    report(f"resumed step {start} of '{run_dir}' on layout {options.layout_description}")
    return state


def _finish(
    options: TrainOptions,
    run_dir: Path,
    steps: _Steps,
    start: int,
    placement: Any,
    bubble: dict[str, Any] | None,
    reference: dict[str, Any] | None,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> dict[str, Any]:
    """Writes loss.png and samples.txt; returns the metrics (history merged with the past).

    ``after`` is ``None`` when training ended early (a signal, a non-finite loss) or
    ``--no-samples`` turned sampling off (then ``before`` is ``None`` too): no samples are
    written then.
    """
    history, invocations = _run_files.previous_metrics(run_dir, start)
    for key in _run_files.HISTORY_KEYS:
        history[key] += steps.history[key]
    evals = _run_files.previous_evals(run_dir, start)
    for key in _run_files.EVAL_KEYS:
        evals[key] += steps.evals[key]
    end = start + steps.count
    invocations.append(
        {
            "start_step": start,
            "end_step": end,
            "layout": options.layout,
            "layers_per_stage": options.layers_per_stage,
        }
    )
    resumed_at = [v["start_step"] for v in invocations if v["start_step"] > 0]
    title = f"{options.model}, {options.layout_description}, {options.schedule}"
    prompt = _sample.DEFAULT_PROMPT
    header = f"{options.model} at step {start} (before) and step {end} (after); prompt {prompt!r}"
    if jax.process_index() == 0:
        _run_files.plot_loss(history, run_dir / _run_files.LOSS_PNG, title, resumed_at, evals)
        if before is not None and after is not None:
            texts = {"before": before["texts"], "after": after["texts"]}
            _run_files.write_samples(run_dir, texts, header)
    return {
        "options": dataclasses.asdict(options),
        "devices": {"platform": jax.devices()[0].platform, "count": jax.device_count()},
        "summary": _summary(options, steps, start),
        "history": history,
        **({"eval_history": evals} if evals["step"] else {}),
        "invocations": invocations,
        "placement": {
            "bytes_per_device": {str(d): b for d, b in placement.bytes_per_device().items()},
            "per_task": placement.per_task(),
        },
        "bubble": bubble,
        "reference": reference,
        "samples": {"before": before, "after": after},
    }


def _summary(options: TrainOptions, steps: _Steps, start: int) -> dict[str, Any]:
    """The run's headline numbers; losses and rates are ``None`` when no step ran."""
    losses = steps.history["loss"]
    finite = [x for x in losses if math.isfinite(x)]
    tokens = options.rows_per_step * options.seq_len
    evaluated = {}
    if steps.evals["step"]:
        evaluated = {
            "first_eval_loss": steps.evals["loss"][0],
            "last_eval_loss": steps.evals["loss"][-1],
            "last_eval_perplexity": steps.evals["perplexity"][-1],
        }
    return {
        "start_step": start,
        "end_step": start + steps.count,
        "stopped_by": steps.stopped_by,
        "nonfinite": steps.nonfinite,
        "skipped_steps": steps.skipped,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "last_10_mean_loss": float(np.mean(finite[-10:])) if finite else None,
        "tokens_per_s": _steady_tokens_per_s(steps, start, tokens) if steps.count else None,
        "compile_s": steps.compile_s,
        "xla_compiles": steps.compilation.get("compiles"),
        "compile_cache_hits": steps.compilation.get("cache_hits"),
        **evaluated,
    }
