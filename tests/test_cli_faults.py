"""``mmflax train`` under faults: signals, kills at random points, non-finite losses, a busy folder.

Each run is a real ``mmflax`` process (signals go to processes, not to a function call), the
tiny GPT with 8 sequences of 32 bytes, sharing the suite's compilation cache. The reference for
every interrupted run is one uninterrupted run of the same steps (``reference_run``): an
interrupted run resumed to its end must reach the same parameters bit for bit, whatever was
killed when.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from multimesh_flax.checkpoint import Checkpointer, latest_step
from multimesh_flax.cli import _cli
from multimesh_flax.cli._run_lock import RunLock

STEPS = 12
# The settings of test_cli_train, so that the two share compiled programs through the cache.
TINY = [
    *("--batch-size", "8", "--seq-len", "32", "--warmup", "5", "--log-every", "4"),
    "--no-samples",
]
TIMEOUT_S = 180  # one process, from start to a finished run; a hang fails the test


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "multimesh_flax.cli", "train", "--out", str(out), *TINY, *extra]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(out, *extra), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def _start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        _command(out, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(process: subprocess.Popen) -> tuple[int, str]:
    """Waits (bounded) for ``process``; returns its status and stderr. Kills it on a hang."""
    try:
        _, err = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"mmflax train (pid {process.pid}) did not exit within {TIMEOUT_S} s")
    return process.returncode, err


def _params(out: Path) -> dict[str, np.ndarray]:
    with Checkpointer(out / "checkpoint", read_only=True) as ckpt:
        assert ckpt.latest_step() == STEPS
        state = ckpt.restore()
    leaves = {"/".join(map(str, k)): np.asarray(v) for k, v in _flatten(state["params"])}
    return leaves


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, (*prefix, key))
    else:
        yield prefix, tree


def _losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "metrics.json").read_text())["history"]
    return dict(zip(history["step"], history["loss"], strict=True))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run of `STEPS` steps (in this process): its folder."""
    out = tmp_path_factory.mktemp("faults") / "reference"
    argv = ["train", "--out", str(out), *TINY, "--steps", str(STEPS), "--save-every", "end"]
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        assert _cli.main(argv) == 0, stderr.getvalue()
    return out


@pytest.mark.heavy
def test_signals_and_kills_at_random_points_resume_to_the_uninterrupted_parameters(
    reference_run, tmp_path
):
    """SIGTERM, then SIGKILL and SIGINT at random moments of a run that saves every step.

    Kills land while JAX starts, while the step compiles, between steps and inside saves
    (every step saves); each time the next invocation resumes, and the last one finishes.
    """
    out = tmp_path / "run"
    process = _start(out, "--steps", str(STEPS), "--save-every", "1")
    _wait_for_training(out, process)
    process.send_signal(signal.SIGTERM)  # a scheduler's preemption
    status, err = _finish(process)
    if status != 0:  # it may have finished first on a fast machine
        assert status == 128 + signal.SIGTERM, err
        assert "stopped by SIGTERM after step" in err and "--resume --out" in err
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["summary"]["stopped_by"] == "SIGTERM"
        assert metrics["summary"]["end_step"] == _latest(out) > 0

    chance = random.Random(34)
    for kind in (signal.SIGKILL, signal.SIGINT):
        if _latest(out) == STEPS:
            break
        process = _start(out, "--resume", "--save-every", "1")
        time.sleep(chance.uniform(2.0, 8.0))  # while starting, training or saving
        process.send_signal(kind)
        status, err = _finish(process)
        assert status in (0, -kind, 128 + kind), err
    if _latest(out) != STEPS:
        done = _run(out, "--resume")
        assert done.returncode == 0, done.stderr
    _assert_same_run(out, reference_run)


def _latest(out: Path) -> int | None:
    return latest_step(out / "checkpoint")


def _wait_for_training(out: Path, process: subprocess.Popen) -> None:
    """Returns once ``process`` has saved its first step (or has ended)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not _latest(out) and process.poll() is None:
        assert time.monotonic() < deadline, "no step saved in time"
        time.sleep(0.1)


def _assert_same_run(out: Path, reference: Path) -> None:
    got, want = _params(out), _params(reference)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    losses, reference_losses = _losses(out), _losses(reference)
    for step, loss in losses.items():
        assert loss == reference_losses[step], step


@pytest.mark.heavy
def test_a_non_finite_step_stops_the_run_naming_it_and_only_finite_states_are_saved(
    tmp_path, capsys
):
    out = tmp_path / "run"
    nan = ["--lr", "1e4", "--warmup", "0", "--save-every", "end"]
    assert _cli.main(["train", "--out", str(out), *TINY, "--steps", "20", *nan]) == 1
    err = capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text(), parse_constant=_reject)
    stopped = metrics["summary"]["end_step"]
    bad = int(re.search(r"Step (\d+) has a non-finite (loss|gradient norm)", err).group(1))
    assert bad in (stopped - 1, stopped) and stopped < 20  # a gradient norm is read a step late
    assert metrics["summary"]["skipped_steps"] == [bad]
    assert f"Training stopped after step {stopped}; the last one saved, step {stopped}" in err
    assert "Lower `--lr`" in err and "--on-nonfinite skip" in err
    with Checkpointer(out / "checkpoint", read_only=True) as ckpt:
        assert ckpt.latest_step() == stopped
        state = ckpt.restore()
    assert all(np.isfinite(x).all() for x in _leaves(state))

    skip = tmp_path / "skip"  # the same run, skipping what is not finite
    assert _cli.main(["train", "--out", str(skip), *TINY, "--steps", "8", *nan,
                      "--on-nonfinite", "skip"]) == 0  # fmt: skip
    assert f"Step {bad} has a non-finite" in capsys.readouterr().err
    metrics = json.loads((skip / "metrics.json").read_text(), parse_constant=_reject)
    assert metrics["summary"]["skipped_steps"][0] == bad
    with Checkpointer(skip / "checkpoint", read_only=True) as ckpt:
        assert ckpt.latest_step() == 8
        assert all(np.isfinite(x).all() for x in _leaves(ckpt.restore()))


def _reject(constant: str):
    raise AssertionError(f"metrics.json holds {constant}, which strict JSON parsers reject")


def _leaves(tree):
    arrays = [np.asarray(v) for v in jax.tree.leaves(tree)]
    return [a for a in arrays if np.issubdtype(a.dtype, np.inexact)]


def test_a_second_writer_of_a_run_folder_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with RunLock(tmp_path / "busy"):
        assert _cli.main(["train", "--out", "busy", *TINY, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"is being written by process {os.getpid()}" in err and "another `--out`" in err
    assert not (tmp_path / "busy" / "checkpoint").exists()
