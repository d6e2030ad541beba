"""``mmflax plan`` and ``mmflax train --plan auto`` (tiny: gpt-tiny with 2 blocks, analytic)."""

from __future__ import annotations

import json

from multimesh_flax.cli import _cli

TINY = ("--model", "gpt-tiny", "--layers", "2", "--batch-size", "8", "--seq-len", "16")


def test_plan_prints_the_ranked_plans_and_how_to_train_the_best(capsys):
    code = _cli.main(
        ["plan", *TINY, "--devices", "2", "--memory", "32MiB", "--recompute", "none", "--top", "3"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "Plans, fastest predicted step first" in out and "best: " in out
    assert "mmflax train --model gpt-tiny --plan auto --memory 32MiB" in out
    rows = [line for line in out.splitlines() if line.startswith("│ ")]
    assert len(rows) == 3  # --top 3


def test_plan_that_cannot_fit_exits_2_naming_the_memory_it_needs(capsys):
    code = _cli.main(
        [
            "plan",
            *TINY,
            "--devices",
            "2",
            "--memory",
            "1KiB",
            "--recompute",
            "none",
            "--schedules",
            "1f1b",
            "--microbatches",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mmflax: Expected a plan that fits `memory_per_device` = ")
    assert "The least memory per device any of them needs is" in err


def test_train_plan_auto_trains_the_best_plan_and_stores_predicted_vs_measured(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "train",
        "--plan",
        "auto",
        "--memory",
        "64MiB",
        "--out",
        str(out),
        *TINY,
        "--steps",
        "2",
        "--no-samples",
        "--warmup",
        "1",
    ]
    code = _cli.main(argv)
    stdout = capsys.readouterr().out
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    plan = metrics["plan"]
    assert "step time: predicted" in stdout and plan["plan"] in stdout
    # the run used the plan's layout, and the placement holds the predicted parameter bytes
    split = metrics["options"]["layers_per_stage"]
    assert plan["plan"].startswith(str(tuple(split)))
    assert plan["predicted_param_bytes_per_stage"] == plan["measured_param_bytes_per_stage"]
    assert plan["measured_step_s"] > 0 and plan["predicted_step_s"] > 0
    assert max(plan["predicted_peak_bytes_per_stage"]) <= 64 * 2**20
