"""``mmflax train --processes 2`` and ``mmflax launch``: the main job across processes.

The pipelined GPT (2 stages x (2 data x 2 tensor), 1F1B, 4 microbatches, 5 steps) trains on
a user's JSONL file (``--dataset``) as 2 launched processes of 4 CPU devices -- 3 steps,
then 2 more resumed from the checkpoint -- and, for the reference, in this process on 8
devices (itself checked against the unstaged model by ``tests/test_cli_train.py``). Each
process builds the same grain stream, reads the part of every batch its devices hold (here
process 0 the inputs for the first stage, process 1 the targets for the last) and resumes
the stream from its checkpoint, so a shifted or lost position changes the losses. The
losses agree to 1e-6 relative; on this host they are bit-for-bit equal (every fragment is
the same XLA program on the same devices, and the cross-process transfers copy values
exactly).
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
import pytest

from models import load_corpus
from multimesh_flax.checkpoint import Checkpointer
from multimesh_flax.cli import _cli
from multimesh_flax.distributed import launch

TRAIN = [
    "train",
    *("--stages", "2", "--data", "2", "--tensor", "2"),
    *("--microbatches", "4", "--schedule", "1f1b", "--steps", "5"),
    *("--batch-size", "8", "--seq-len", "32", "--warmup", "5", "--log-every", "1"),
    "--no-samples",
]


def _poe_jsonl(folder):
    """The shipped Poe poems as a user's JSONL file, one stanza per document."""
    stanzas = [d for d in load_corpus("poe_poems").split("\n\n") if d.strip()]
    path = folder / "poe.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in stanzas))
    return str(path)


def _losses(out):
    return np.asarray(json.loads((out / "metrics.json").read_text())["history"]["loss"])


def _launch_train(out, *extra):
    """``mmflax train`` as 2 launched processes of 4 devices; returns process 0's output."""
    command = _cli.train_command([*TRAIN, *extra, "--processes", "2"], str(out))
    assert "--processes" not in command and command[command.index("--out") + 1] == str(out)
    result = launch(2, command, devices_per_process=4, timeout=240, stream=None)
    assert result.returncode == 0, result.output(0)[-3000:] + result.output(1)[-3000:]
    assert "wrote" in result.output(0) and "wrote" not in result.output(1)  # process 0 writes
    return result.output(0)


@pytest.mark.heavy
def test_train_in_two_processes_matches_one_process(tmp_path, capsys):
    """Steps 1-3 in 2 processes, then ``--resume`` for steps 4-5 in 2 processes: the same
    losses and checkpoint as 5 steps in one process."""
    multi, single = tmp_path / "multi", tmp_path / "single"
    data = ("--dataset", _poe_jsonl(tmp_path))
    _launch_train(multi, *data, "--steps", "3")
    assert (multi / "checkpoint" / "3").is_dir()
    assert "resumed step 3" in _launch_train(multi, *data, "--steps", "2", "--resume")
    assert (multi / "checkpoint" / "5").is_dir()
    assert _cli.main([*TRAIN, *data, "--out", str(single)]) == 0
    capsys.readouterr()
    assert len(_losses(multi)) == 5
    np.testing.assert_allclose(_losses(multi), _losses(single), rtol=1e-6, atol=0)
    saved = [Checkpointer(d / "checkpoint", read_only=True).restore() for d in (multi, single)]
    leaves = [jax.tree.leaves(jax.tree.map(np.asarray, tree)) for tree in saved]
    assert len(leaves[0]) == len(leaves[1]) > 0
    for a, b in zip(*leaves, strict=True):  # the 2-process checkpoint restores in 1 process
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_launch_command_runs_every_rank_and_reports_failure(capfd):
    ok = "import os; print('rank', os.environ['MMFLAX_PROCESS_ID'])"
    assert _cli.main(["launch", "-n", "2", "--timeout", "60", "--", sys.executable, "-c", ok]) == 0
    out = capfd.readouterr().out
    assert "[0] rank 0" in out and "[1] rank 1" in out
    fail = "import os, sys; sys.exit(3 if os.environ['MMFLAX_PROCESS_ID'] == '1' else 0)"
    assert _cli.main(["launch", "-n", "2", "--", sys.executable, "-c", fail]) == 3


def test_launch_command_rejects_a_bad_process_count(capsys):
    assert _cli.main(["launch", "-n", "0", "--", sys.executable, "-c", "pass"]) == 2
    assert "`n` as a positive number of processes" in capsys.readouterr().err
