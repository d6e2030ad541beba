"""The files of an ``mmflax train`` run folder, apart from the checkpoint.

* ``metrics.json``: the run's settings, the per-step history (loss, step time, tokens/s),
  a summary, the parameter bytes per device, the recorded and simulated pipeline bubble, the
  reference check and the samples; one entry per invocation in ``"invocations"``.
* ``loss.png``: the loss curve of every step so far, with a smoothed line and a dashed line
  where a resumed invocation started.
* ``samples.txt``: text generated before and after this invocation's training.

A resumed run reads the previous ``metrics.json`` (`previous_metrics`) and extends its
history and invocations, so the files always describe the whole run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

METRICS = "metrics.json"
LOSS_PNG = "loss.png"
TIMELINE_PNG = "timeline.png"
SAMPLES = "samples.txt"
HISTORY_KEYS = ("step", "loss", "step_time_s", "tokens_per_s")


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
    metrics = json.loads(path.read_text())
    history = metrics.get("history", {})
    keep = [i for i, step in enumerate(history.get("step", [])) if step <= upto_step]
    trimmed = {key: [history.get(key, [])[i] for i in keep] for key in HISTORY_KEYS}
    invocations = [v for v in metrics.get("invocations", []) if v["end_step"] <= upto_step]
    return trimmed, invocations


def write_metrics(run_dir: Path, metrics: Mapping[str, Any]) -> Path:
    """Writes ``metrics`` as indented JSON to ``run_dir/metrics.json``."""
    path = run_dir / METRICS
    path.write_text(json.dumps(metrics, indent=1) + "\n")
    return path


def _smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (fewer at the start)."""
    array = np.asarray(values, dtype=np.float64)
    window = max(1, min(window, len(array)))
    head = np.cumsum(array[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(array, np.ones(window) / window, mode="valid")])


def plot_loss(
    history: Mapping[str, Sequence[float]], path: Path, title: str, resumed_at: Sequence[int]
) -> None:
    """Draws the loss per step (and a moving average) into the PNG ``path``."""
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
