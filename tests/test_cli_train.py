"""``mmflax train`` and ``mmflax sample`` through the CLI's Python entry (``_cli.main``).

Every training run is tiny (gpt-tiny, 8 sequences of 32 bytes); compiling dominates. Losses
are compared with the unstaged model on one device (``--check-reference``) and, for resuming,
with the uninterrupted run of the same steps: the module's one long run (``whole_run``), which
the two tests that use it share (they stand first, so that pytest-xdist gives both to one
worker).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from models import load_corpus
from multimesh_flax.checkpoint import Checkpointer
from multimesh_flax.cli import _cli, _run_options, _sample
from multimesh_flax.cli.errors import RunOptionError

# One worker runs these tests (dev.py's --dist loadgroup): they share the trained run.
pytestmark = pytest.mark.xdist_group("test_cli_train")

# Text generation before and after training compiles four programs; only `whole_run` samples.
TINY = [
    *("--batch-size", "8", "--seq-len", "32", "--warmup", "5", "--log-every", "4"),
    "--no-samples",
]
STEPS = 24
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _train_cli(capsys, out, *extra):
    code = _cli.main(["train", "--out", str(out), *TINY, *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads((out / "metrics.json").read_text()), captured.out


def _losses(metrics):
    return np.asarray(metrics["history"]["loss"])


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """``(run folder, metrics, stdout)`` of one uninterrupted run with ``--check-reference``."""
    out = tmp_path_factory.mktemp("cli") / "whole"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = _cli.main(
            ["train", "--out", str(out), *TINY, "--steps", str(STEPS), "--check-reference"]
            + ["--samples"]  # this run's samples are checked below
        )
    assert code == 0, stderr.getvalue()
    return out, json.loads((out / "metrics.json").read_text()), stdout.getvalue()


def test_train_writes_every_artifact_and_matches_the_unstaged_model(whole_run, capsys):
    out, metrics, stdout = whole_run
    assert "Parameter placement" in stdout and "reference check" in stdout
    for name in ("loss.png", "timeline.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)
    assert {"options", "summary", "history", "placement", "bubble", "reference", "samples"} <= set(
        metrics
    )
    assert metrics["history"]["step"] == list(range(1, STEPS + 1))
    assert len(metrics["history"]["loss"]) == len(metrics["history"]["tokens_per_s"]) == STEPS
    assert set(metrics["placement"]["bytes_per_device"]) == {str(i) for i in range(8)}
    assert 0 <= metrics["bubble"]["recorded"] < 1 and 0 < metrics["bubble"]["simulated"] < 1
    assert metrics["reference"]["checked_steps"] == 20
    assert metrics["reference"]["max_rel_diff_all_steps"] <= 1e-5
    losses = _losses(metrics)
    assert losses[-4:].mean() < losses[0] - 1.0  # 5.6 nats per byte falls well below 4.6
    corpus = load_corpus("shakespeare_sonnets")
    texts = {k: v["texts"]["sampled (temperature 0.8)"] for k, v in metrics["samples"].items()}
    chars = {k: _sample.corpus_match_rate(t, corpus, n=1) for k, t in texts.items()}
    assert chars["after"] > max(chars["before"], 0.9)  # bytes the corpus uses, not noise
    assert "=== after training, greedy ===" in (out / "samples.txt").read_text()

    with Checkpointer(out / "checkpoint", read_only=True) as ckpt:
        assert ckpt.latest_step() == STEPS
        assert ckpt.metadata()["run"]["seq_len"] == 32
    config, params, _ = _sample.restore_params(out)
    assert config.num_layers == 2
    assert {d.id for leaf in jax.tree.leaves(params) for d in leaf.devices()} == {0}

    assert _cli.main(["sample", "--checkpoint", str(out), "--tokens", "20", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Shall I ") and len(text.strip()) > len("Shall I ")
    assert _cli.main(["sample", "--checkpoint", str(out), "--tokens", "500"]) == 2
    assert "`--tokens` between 0 and 119" in capsys.readouterr().err

    assert _cli.main(["train", "--out", str(out), "--steps", "1"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert _cli.main(["train", "--out", str(out), "--resume", "--seq-len", "16"]) == 2
    assert "differs from 32" in capsys.readouterr().err


def test_resume_continues_bit_for_bit_and_onto_another_layout(
    whole_run, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # relative run folders, as typed on a command line
    whole, half = whole_run[1], str(STEPS // 2)
    _train_cli(capsys, Path("same"), "--steps", half)
    shutil.copytree("same", "other")

    same, stdout = _train_cli(capsys, Path("same"), "--steps", half, "--resume")
    assert f"resumed step {half}" in stdout
    np.testing.assert_array_equal(_losses(same), _losses(whole))  # history keeps steps 1-12
    assert [v["layout"] for v in same["invocations"]] == ["2x2x2", "2x2x2"]

    layout = ["--stages", "1", "--data", "2", "--tensor", "4"]
    other, _ = _train_cli(capsys, Path("other"), "--steps", half, "--resume", *layout)
    np.testing.assert_allclose(_losses(other), _losses(whole), rtol=1e-5)
    assert other["invocations"][-1]["layout"] == "1x2x4"


def test_default_arguments_parse_to_the_documented_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _cli._parser().parse_args(["train"])
    given = {k: v for k, v in vars(args).items() if k not in ("command", "devices")}
    options = _run_options.resolve_options({**given, "resume": None})
    assert (options.model, options.layers, options.layout) == ("gpt-tiny", 2, "2x2x2")
    assert (options.microbatches, options.schedule, options.steps) == (4, "1f1b", 400)
    assert str(options.out).startswith("runs/") and not options.resume
    assert args.devices == 8
    assert _run_options.check_options(options, jax.device_count()).num_layers == 2
    assert not (tmp_path / "runs").exists()  # nothing is written before training


def test_layers_per_stage_sets_the_stage_count_and_resume_may_change_it(monkeypatch):
    def resolve(*args):
        parsed = vars(_cli._parser().parse_args(["train", "--out", "run", *args]))
        given = {k: v for k, v in parsed.items() if k not in ("command", "devices")}
        return _run_options.resolve_options(given)

    uneven = resolve("--layers", "8", "--layers-per-stage", "1,3,3,1", "--tensor", "1")
    assert (uneven.stages, uneven.layers_per_stage, uneven.layout) == (4, (1, 3, 3, 1), "4x2x1")
    assert _run_options.check_options(uneven, jax.device_count()).num_layers == 8
    with pytest.raises(RunOptionError, match=r"`--stages` 2 and `--layers-per-stage` 1,3,3,1"):
        resolve("--stages", "2", "--layers-per-stage", "1,3,3,1")
    # A resumed run keeps its saved split (a JSON list) unless --stages or
    # --layers-per-stage gives a new one.
    saved = {k: getattr(uneven, k) for k in (*_run_options.RUN_KEYS, *_run_options.LAYOUT_KEYS)}
    saved["layers_per_stage"] = [1, 3, 3, 1]
    monkeypatch.setattr(_run_options, "_resume_dir", Path)
    monkeypatch.setattr(_run_options, "_saved_options", lambda run_dir: saved)
    kept = resolve("--resume")
    assert (kept.stages, kept.layers_per_stage) == (4, (1, 3, 3, 1))
    even = resolve("--resume", "--stages", "2")
    assert (even.stages, even.layers_per_stage) == (2, None)
    other = resolve("--resume", "--layers-per-stage", "3,5")
    assert (other.stages, other.layers_per_stage) == (2, (3, 5))


BAD_TRAIN_ARGS = {
    "stages_do_not_divide_layers": (["--stages", "3"], "does not divide the 2 layers"),
    "device_product_mismatch": (["--tensor", "1"], "= 8 (the devices available)"),
    "unknown_preset": (["--model", "gpt-huge"], "gpt-tiny, gpt-small, llama-tiny, llama-1b"),
    "microbatches_do_not_divide_batch": (["--microbatches", "3"], "multiple of `--microbatches`"),
    "tensor_does_not_divide_heads": (["--stages", "1", "--tensor", "8", "--data", "1"], "heads"),
    "sequence_too_long": (["--seq-len", "129"], "`--seq-len` <= 128"),
    "non_positive_steps": (["--steps", "0"], "`--steps` to be a positive integer"),
    "layers_per_stage_wrong_sum": (["--layers-per-stage", "1,2"], "add up to the 2 layers"),
    "layers_per_stage_empty_middle": (
        ["--layers", "4", "--layers-per-stage", "2,0,2"],
        "leaves stage 1 without blocks",
    ),
    "v_schedule_odd_stages": (
        ["--schedule", "zero-bubble-v", "--stages", "1", "--data", "4"],
        "two stages per submesh, on a V; expected an even `--stages`",
    ),
    "v_schedule_device_product": (
        ["--schedule", "zero-bubble-v", "--stages", "2"],
        "`--stages` / 2 x `--data` x `--tensor` = 8",
    ),
}


def test_v_schedule_puts_two_stages_on_each_submesh():
    parsed = vars(_cli._parser().parse_args(["train", "--schedule", "zero-bubble-v"]))
    given = {k: v for k, v in parsed.items() if k not in ("command", "devices", "resume")}
    options = _run_options.resolve_options({**given, "stages": 4, "layers": 4, "out": "unused"})
    _run_options.check_options(options, 8)
    assert (options.submeshes, options.stage_submeshes) == (2, (0, 1, 1, 0))


@pytest.mark.parametrize("args, match", BAD_TRAIN_ARGS.values(), ids=BAD_TRAIN_ARGS.keys())
def test_bad_training_options_raise_run_option_error(args, match):
    parsed = vars(_cli._parser().parse_args(["train", *args]))
    given = {k: v for k, v in parsed.items() if k not in ("command", "devices", "resume")}
    options = _run_options.resolve_options({**given, "out": "unused"})
    with pytest.raises(RunOptionError, match=re.escape(match)):
        _run_options.check_options(options, jax.device_count())


BAD_COMMANDS = {
    **{name: (["train", *args], match) for name, (args, match) in BAD_TRAIN_ARGS.items()},
    "resume_without_checkpoint": (["train", "--resume", "--out", "nowhere"], "no finalized"),
    "sample_without_checkpoint": (["sample", "--checkpoint", "nowhere"], "no finalized"),
    "sample_without_argument": (["sample"], "--checkpoint"),
    "other_device_count": (["train", "--devices", "4"], "already runs with 8 CPU devices"),
    "unknown_schedule": (["train", "--schedule", "zigzag"], "invalid choice"),
    "not_a_number": (["train", "--steps", "many"], "invalid int value"),
    "layers_per_stage_not_counts": (["train", "--layers-per-stage", "1;3"], "separated by commas"),
    "unknown_command": (["fly"], "invalid choice"),
    "odd_demo_devices": (["demo", "--devices", "3"], "even number"),
}


@pytest.mark.parametrize("argv, match", BAD_COMMANDS.values(), ids=BAD_COMMANDS.keys())
def test_bad_arguments_exit_2_with_a_message(argv, match, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmflax: ") and match in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # failed before writing anything
