"""The files of an ``mmflax train`` run folder, apart from the checkpoint.

* ``metrics.json``: the run's settings, the per-step history (loss, step time, tokens/s),
  the held-out evaluations of a ``--dataset`` run (``eval_history``: step, loss, perplexity),
  a summary, the parameter bytes per device, the recorded and simulated pipeline bubble, the
  reference check and the samples; one entry per invocation in ``"invocations"``.
* ``loss.png``: the loss curve of every step so far, with a smoothed line, the held-out
  loss where it was measured, and a dashed line where a resumed invocation started.
* ``samples.txt``: text generated before and after this invocation's training.
* ``run.json``: the settings of the run, written when an invocation starts, so that
  ``--resume`` can restart a run none of whose saves finished (`write_settings`).

``metrics.json`` is strict JSON: a NaN or infinite loss is written as ``null``.

A resumed run reads the previous ``metrics.json`` (`previous_metrics`) and extends its
history and invocations, so the files always describe the whole run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

METRICS = "metrics.json"
LOSS_PNG = "loss.png"
TIMELINE_PNG = "timeline.png"
SAMPLES = "samples.txt"
SETTINGS = "run.json"
HISTORY_KEYS = ("step", "loss", "step_time_s", "tokens_per_s")
EVAL_KEYS = ("step", "loss", "perplexity")


def empty_history() -> dict[str, list[float]]:
    """``{key: []}`` for every per-step series."""
    return {key: [] for key in HISTORY_KEYS}


def previous_metrics(run_dir: Path, upto_step: int) -> tuple[dict[str, list], list[dict]]:
    """``(history, invocations)`` of ``run_dir``'s metrics, up to step ``upto_step``.

    Steps after ``upto_step`` (trained after the checkpoint being resumed) are dropped.
    Returns empty ones when there is no ``metrics.json``.
    """
    path = run_dir / METRICS
    if not path.is_file():
        return empty_history(), []
    try:
        metrics = json.loads(path.read_text())
        history = metrics.get("history", {})
    except (ValueError, AttributeError) as e:  # garbage: say so, and keep the run going
        logger.warning("Ignoring the unreadable %s (%s): its history starts anew", path, e)
        return empty_history(), []
    history["loss"] = [float("nan") if x is None else x for x in history.get("loss", [])]
    keep = [i for i, step in enumerate(history.get("step", [])) if step <= upto_step]
    trimmed = {key: [history.get(key, [])[i] for i in keep] for key in HISTORY_KEYS}
    invocations = [v for v in metrics.get("invocations", []) if v["end_step"] <= upto_step]
    return trimmed, invocations


def empty_evals() -> dict[str, list[float]]:
    """``{key: []}`` for every series of held-out evaluations."""
    return {key: [] for key in EVAL_KEYS}


def previous_evals(run_dir: Path, before_step: int) -> dict[str, list[float]]:
    """The evaluations in ``run_dir``'s metrics at steps before ``before_step``.

    An evaluation at ``before_step`` itself is dropped: the resumed invocation repeats it.
    """
    try:
        evals = json.loads((run_dir / METRICS).read_text()).get("eval_history", {})
        keep = [i for i, step in enumerate(evals.get("step", [])) if step < before_step]
        return {key: [evals[key][i] for i in keep] for key in EVAL_KEYS}
    except (OSError, ValueError, AttributeError, KeyError, IndexError):
        return empty_evals()  # no metrics yet, or unreadable (`previous_metrics` says so)


def write_metrics(run_dir: Path, metrics: Mapping[str, Any]) -> Path:
    """Writes ``metrics`` as indented strict JSON to ``run_dir/metrics.json``.

    Non-finite floats (a NaN loss) become ``null``, which every JSON parser reads.
    """
    path = run_dir / METRICS
    path.write_text(json.dumps(_strict(metrics), indent=1, allow_nan=False) + "\n")
    return path


def _strict(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by ``None``."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value


def write_settings(run_dir: Path, settings: Mapping[str, Any]) -> Path:
    """Writes the run's ``settings`` (the checkpoint metadata at its start) to run.json."""
    path = run_dir / SETTINGS
    path.write_text(json.dumps(settings, indent=1) + "\n")
    return path


def read_settings(run_dir: Path) -> dict[str, Any] | None:
    """The settings `write_settings` wrote in ``run_dir``, or ``None`` (none or unreadable)."""
    try:
        return json.loads((run_dir / SETTINGS).read_text())
    except (OSError, ValueError):
        return None


def _smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (fewer at the start)."""
    array = np.asarray(values, dtype=np.float64)
    window = max(1, min(window, len(array)))
    head = np.cumsum(array[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(array, np.ones(window) / window, mode="valid")])


def plot_loss(
    history: Mapping[str, Sequence[float]],
    path: Path,
    title: str,
    resumed_at: Sequence[int],
    evals: Mapping[str, Sequence[float]] | None = None,
) -> None:
    """Draws the loss per step, a moving average and held-out ``evals`` into ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    steps, losses = history["step"], history["loss"]
    axes.plot(steps, losses, color="#9ab", linewidth=0.8, label="loss")
    if losses:
        window = max(1, len(losses) // 20)
        axes.plot(steps, _smooth(losses, window), color="#246", label=f"mean of {window}")
    if evals and evals["step"]:
        axes.plot(evals["step"], evals["loss"], "o-", color="#d80", label="held-out loss")
    for step in resumed_at:
        axes.axvline(step, color="#c44", linestyle="--", linewidth=0.8)
    axes.set_xlabel("step")
    axes.set_ylabel("cross entropy (nats per byte)")
    axes.set_title(title)
    axes.legend()
    figure.savefig(path, dpi=110)


def write_samples(run_dir: Path, samples: Mapping[str, Mapping[str, str]], header: str) -> Path:
    """Writes ``{moment: {kind: text}}`` (e.g. before/after x greedy/sampled) to samples.txt."""
    parts = [header, ""]
    for moment, texts in samples.items():
        for kind, text in texts.items():
            parts += [f"=== {moment} training, {kind} ===", text, ""]
    path = run_dir / SAMPLES
    path.write_text("\n".join(parts))
    return path
