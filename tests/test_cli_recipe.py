"""``mmflax train``'s fine-tuning recipe: cosine decay, clipping, gradient accumulation,
precision, recomputation and TensorBoard.

The unit tests check the schedule against its closed form and the optimizer against plain
optax, without compiling a model. The CLI tests share two tiny runs of 4 steps on a JSONL
file (module fixtures), float32 with TensorBoard and bfloat16, both with ``--lr-schedule
cosine --grad-accum 2``, and resume the float32 one after its step 2 with full
recomputation. The accumulated update is checked against a plain computation on one
device: each batch's gradient taken separately, averaged, clipped and applied by an optax
AdamW with the closed-form rate. Bad values are in the catalogue of
``tests/test_bad_inputs.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import GPT, cross_entropy_loss, get_config, load_corpus
from multimesh_flax.checkpoint import Checkpointer
from multimesh_flax.cli import _cli, _data, _optimizer, _recipe, _run_options, _sample, _train
from multimesh_flax.cli._optimizer import OptimizerSettings
from multimesh_flax.cli.errors import RunOptionError

# One worker runs these tests (dev.py's --dist loadgroup): they share the recipe runs.
pytestmark = pytest.mark.xdist_group("test_cli_recipe")

LR, WARMUP, RATIO, CLIP, STEPS = 5e-3, 1, 0.2, 0.5, 4
TINY = [
    *("--batch-size", "8", "--seq-len", "32", "--microbatches", "2", "--log-every", "1"),
    "--no-samples",
]
RECIPE = [
    *("--lr-schedule", "cosine", "--warmup", str(WARMUP), "--min-lr-ratio", str(RATIO)),
    *("--clip-norm", str(CLIP), "--grad-accum", "2", "--steps", str(STEPS)),
    *("--save-every", "2", "--eval-fraction", "0.2"),
]
BF16_TRACKS = dict(rtol=1e-2, atol=0)
"""bfloat16 keeps 8 mantissa bits (relative rounding 4e-3): over 4 steps from a near-uniform
start the losses stay within 1% of the float32 run's."""
RECOMPUTED = dict(rtol=1e-5, atol=1e-6)
"""Recomputing runs the same operations, fused differently: over 4 steps the losses came out
identical and the parameters within 6e-7 (float32 rounding that Adam's update carries)."""


def _rate(count, lr=LR, warmup=WARMUP, horizon=STEPS, ratio=RATIO):
    """The cosine schedule written out: a ramp from 0, then half a cosine to the floor."""
    if count < warmup:
        return lr * count / warmup
    progress = min(count - warmup, horizon - 1 - warmup) / (horizon - 1 - warmup)
    return lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# --- the optimizer, without a model -----------------------------------------------------------


@pytest.mark.parametrize(
    "warmup, horizon, ratio", [(0, 10, 0.1), (3, 10, 0.0), (30, 400, 0.1), (1, 3, 1.0)]
)
def test_cosine_schedule_matches_its_closed_form(warmup, horizon, ratio):
    settings = OptimizerSettings(lr=0.1, warmup=warmup, lr_schedule="cosine", min_lr_ratio=ratio)
    rate = _optimizer.make_schedule(settings, horizon)
    counts = range(horizon + 5)  # past the last step the rate stays at the floor
    got = [float(rate(c)) for c in counts]
    want = [_rate(c, 0.1, warmup, horizon, ratio) for c in counts]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    assert got[horizon - 1] == pytest.approx(0.1 * ratio)  # the floor, at the run's last step


def test_constant_schedule_is_the_warmup_ramp_to_lr():
    rate = _optimizer.make_schedule(OptimizerSettings(lr=0.1, warmup=4), horizon=None)
    got = [float(rate(c)) for c in range(8)]
    np.testing.assert_allclose(got, [0.1 * min(c / 4, 1.0) for c in range(8)], rtol=1e-6)


def test_cosine_needs_a_step_after_the_warmup():
    settings = OptimizerSettings(lr=0.1, warmup=3, lr_schedule="cosine")
    _optimizer.check_schedule(settings, 5)
    with pytest.raises(RunOptionError, match=re.escape("`--warmup` <= 2, more `--steps`")):
        _optimizer.check_schedule(settings, 4)


@pytest.mark.parametrize("clip_norm", [0.0, 0.5])
def test_clipping_is_plain_optax_clipping_before_adamw(clip_norm):
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    grads = {"w": jnp.full((2, 3), 4.0)}  # global norm 9.8
    settings = OptimizerSettings(lr=0.1, warmup=0, clip_norm=clip_norm)
    tx = _optimizer.make_optimizer(settings)
    updates, _ = tx.update(grads, tx.init(params), params)
    scale = min(1.0, clip_norm / float(np.linalg.norm(grads["w"]))) if clip_norm else 1.0
    plain = optax.adamw(0.1, b2=0.95, weight_decay=0.01)
    want, _ = plain.update(jax.tree.map(lambda g: g * scale, grads), plain.init(params), params)
    np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-6)
    clipped = _optimizer.make_optimizer(OptimizerSettings(lr=0.1, warmup=0))
    shape = jax.tree.structure(tx.init(params))
    assert shape == jax.tree.structure(clipped.init(params))  # checkpoints look alike


def test_settings_missing_from_older_runs_take_the_defaults():
    old = OptimizerSettings.of({"lr": 0.01, "warmup": 5, "model": "gpt-tiny"})
    assert old == OptimizerSettings(lr=0.01, warmup=5, lr_schedule="constant", clip_norm=1.0)


def test_accumulated_batches_are_consecutive_batches_stacked():
    tokens = _recipe.corpus_tokens("shakespeare_sonnets")
    single = _recipe.batch_stream(tokens, 4, 16, seed=3)
    batches = [next(single) for _ in range(6)]
    stacked = _recipe.batch_stream(tokens, 4, 16, seed=3, start=1, accumulate=2)
    for step in (1, 2):
        got = next(stacked)
        for key in ("inputs", "targets"):
            want = np.concatenate([b[key] for b in batches[2 * step : 2 * step + 2]])
            np.testing.assert_array_equal(got[key], want)


BAD = {
    "grad_accum": ({"grad_accum": 0}, "`--grad-accum` to be a positive integer, got 0"),
    "ratio": ({"min_lr_ratio": 1.5}, "`--min-lr-ratio` between 0 and 1"),
    "clip": ({"clip_norm": -1.0}, "or 0 or 'none' to clip nothing, got -1.0"),
    "precision": ({"precision": "fp16"}, "Unknown `--precision` 'fp16'"),
    "recompute": ({"recompute": "all"}, "Unknown `--recompute` 'all'"),
    "schedule": ({"lr_schedule": "linear"}, "Unknown `--lr-schedule` 'linear'"),
    "short_cosine": ({"lr_schedule": "cosine", "steps": 20}, "`--warmup` <= 18"),
    "reference_bf16": ({"precision": "bf16", "check_reference": True}, "`--precision fp32`"),
}


@pytest.mark.parametrize("given, match", BAD.values(), ids=BAD.keys())
def test_bad_recipe_values_raise_run_option_error(given, match):
    options = _run_options.TrainOptions(out="unused", **given)
    with pytest.raises(RunOptionError, match=re.escape(match)):
        _run_options.check_options(options, jax.device_count())


def test_clip_norm_none_parses_to_no_clipping():
    args = _cli._parser().parse_args(["train", "--clip-norm", "none"])
    assert args.clip_norm == 0.0


# --- three runs of the recipe ------------------------------------------------------------------


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """The Poe poems as a JSONL file, one stanza per line."""
    path = tmp_path_factory.mktemp("recipe-data") / "poe.jsonl"
    docs = [d for d in load_corpus("poe_poems").split("\n\n") if d.strip()]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _train_cli(out: Path, *argv: str) -> dict:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = _cli.main(["train", "--out", str(out), *TINY, *argv])
    assert code == 0, err.getvalue()
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, jsonl):
    out = tmp_path_factory.mktemp("recipe") / "fp32"
    metrics = _train_cli(
        out, "--dataset", str(jsonl), *RECIPE, "--eval-every", "2", "--tensorboard"
    )
    return out, metrics


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, jsonl):
    """The bf16 run, and what its step sends between stages (a spy on `_train._build`)."""
    out, seen, build = tmp_path_factory.mktemp("recipe") / "bf16", {}, _train._build

    def spy(options, config, horizon):
        built = build(options, config, horizon)
        shape = (options.rows_per_step, options.seq_len)
        batch = {key: np.zeros(shape, np.int32) for key in ("inputs", "targets")}
        exe = built.step_fn.executable(built.state, batch)
        var_of = {slot: var for (var, _), slot in exe._slots.items()}
        seen["sent"] = [var_of[s].aval for op in exe.ops if op.kind != 0 for s in op.outs]
        seen["state"] = {str(a.dtype) for a in jax.tree.leaves(built.state) if a.ndim}
        seen["compute"] = config.dtype
        return built

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_train, "_build", spy)
        metrics = _train_cli(out, "--dataset", str(jsonl), *RECIPE, "--precision", "bf16")
    return out, metrics, seen


def _params(run_dir: Path, step: int | None = None):
    """The parameters (and optimizer state) of checkpoint ``step`` (latest: ``None``)."""
    run_dir = Path(run_dir)
    if step is None:
        return _sample.restore_params(run_dir)[1], None
    with Checkpointer(run_dir / "checkpoint", read_only=True) as ckpt:
        metadata = ckpt.metadata(step)
        config = _recipe.run_config("gpt-tiny", None, None)
        target = _sample._abstract_state(config, metadata["run"], metadata["target_step"])
        state = ckpt.restore(step, target=target)
    return state.params, state.opt_state


def _assert_trees_close(got, want, **tolerance):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tolerance)


def _rate_traced(count):
    """`_rate` for a traced ``count``."""
    cosine = jnp.cos(jnp.pi * (count - WARMUP) / (STEPS - 1 - WARMUP))
    return jnp.where(
        count < WARMUP, LR * count / WARMUP, LR * (RATIO + (1 - RATIO) * 0.5 * (1 + cosine))
    )


@jax.jit
def _reference_step(params, opt_state, batches, weights):
    """One plain AdamW step on one device from the gradient of each of ``batches`` (stacked)
    taken alone, combined with ``weights``, clipped to `CLIP`, at the closed-form rate."""
    model = GPT(get_config("gpt-tiny"))

    def loss(p, batch):
        return cross_entropy_loss(model.apply({"params": p}, batch["inputs"]), batch["targets"])

    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, batches)  # one per batch
    combined = jax.tree.map(lambda g: jnp.tensordot(weights, g, axes=1), grads)
    tx = optax.chain(
        optax.clip_by_global_norm(CLIP), optax.adamw(_rate_traced, b2=0.95, weight_decay=0.01)
    )
    updates, opt_state = tx.update(combined, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _reference_updates(params, opt_state, step_batches, weights=(0.5, 0.5)):
    """`_reference_step` over the steps' batches; ``(1, 0)`` uses each step's first only."""
    for batches in step_batches:
        stacked = jax.tree.map(lambda *b: np.stack(b), *batches)
        params, opt_state = _reference_step(params, opt_state, stacked, np.asarray(weights))
    return params


def test_grad_accum_update_is_the_mean_of_the_batches_gradients(fp32_run, jsonl, tmp_path):
    out, metrics = fp32_run
    assert metrics["summary"]["tokens_per_s"] > 0 and metrics["options"]["grad_accum"] == 2
    data, _ = _data.prepare_dataset(
        str(jsonl),
        _recipe.TOKENIZER,
        text_field="text",
        seq_len=32,
        batch_size=8,
        eval_fraction=0.2,
        run_dir=tmp_path,
    )
    stream = data.train_stream(8, seed=0)  # batches of 8: steps 3 and 4 read batches 4-7
    batches = [next(stream) for _ in range(8)]
    params, opt_state = _params(out, 2)
    want = _reference_updates(params, opt_state, [batches[4:6], batches[6:8]])
    got, _ = _params(out, 4)
    _assert_trees_close(got, want, rtol=2e-4, atol=2e-6)
    wrong = _reference_updates(params, opt_state, [batches[4:6], batches[6:8]], (1.0, 0.0))
    with pytest.raises(AssertionError):  # the check can tell one batch from the average
        _assert_trees_close(got, wrong, rtol=2e-4, atol=2e-6)


def _events(folder: Path):
    """``(file, event)`` of every record of the event files in ``folder``, CRCs checked."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            header = data[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
            payload = data[pos + 12 : pos + 12 + length]
            crc = data[pos + 12 + length : pos + 16 + length]
            assert struct.unpack("<I", crc)[0] == masked_crc32c(payload)
            yield path, Event.FromString(payload)
            pos += 16 + length


def _scalars(folder: Path):
    """``{tag: {step: value}}`` per event file."""
    files = {}
    for path, event in _events(folder):
        for value in event.summary.value:
            files.setdefault(path.name, {}).setdefault(value.tag, {})[event.step] = (
                value.simple_value
            )
    return list(files.values())


def test_tensorboard_holds_the_runs_scalars(fp32_run):
    out, metrics = fp32_run
    (scalars,) = _scalars(out / "tensorboard")
    train_steps = list(range(1, STEPS + 1))
    assert {tag: sorted(steps) for tag, steps in scalars.items()} == {
        "train/loss": train_steps,
        "train/learning_rate": train_steps,
        "train/grad_norm": train_steps,
        "train/tokens_per_s": train_steps,
        "eval/loss": [0, 2, 4],
        "eval/perplexity": [0, 2, 4],
    }
    np.testing.assert_allclose(
        [scalars["train/learning_rate"][s] for s in train_steps],
        [_rate(s - 1) for s in train_steps],  # step s uses the rate at count s - 1
        rtol=1e-6,
    )
    history = metrics["history"]
    np.testing.assert_allclose(list(scalars["train/loss"].values()), history["loss"], rtol=1e-6)
    evals = metrics["eval_history"]
    np.testing.assert_allclose([scalars["eval/loss"][s] for s in (0, 2, 4)], evals["loss"])
    norms = np.array(list(scalars["train/grad_norm"].values()))
    assert np.isfinite(norms).all() and (norms > CLIP).all()  # clipping had work to do


def test_resumed_run_continues_the_schedule_and_may_recompute(fp32_run, tmp_path):
    """An invocation killed after its save of step 2 (of 4) resumes with the same horizon,
    here with ``--recompute full`` (a resumed run may change it): steps 3 and 4 repeat the
    uninterrupted run's losses and parameters. A wrong horizon would change the rate of
    step 3 by a quarter (and a horizon of the 2 steps left is refused)."""
    out, metrics = fp32_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "checkpoint" / str(STEPS))
    resumed = _train_cli(copy, "--resume", "--recompute", "full")
    assert resumed["summary"]["start_step"] == 2 and resumed["summary"]["end_step"] == STEPS
    assert resumed["options"]["recompute"] == "full" and resumed["options"]["tensorboard"]
    losses, uninterrupted = resumed["history"]["loss"], metrics["history"]["loss"]
    assert losses[:2] == uninterrupted[:2]
    np.testing.assert_allclose(losses[2:], uninterrupted[2:], **RECOMPUTED)
    _assert_trees_close(_params(copy)[0], _params(out)[0], **RECOMPUTED)
    restarts = [e.step for _, e in _events(copy / "tensorboard") if e.session_log.status]
    assert restarts == [3]  # TensorBoard drops the steps from 3 on of the earlier file


def test_bf16_computes_in_bfloat16_and_tracks_fp32(bf16_run, fp32_run):
    (_, fp32), (out, bf16, seen) = fp32_run, bf16_run
    assert seen["compute"] == jnp.bfloat16 and seen["state"] == {"float32"}
    activations = {str(a.dtype) for a in seen["sent"] if a.shape == (4, 32, 64)}
    assert activations == {"bfloat16"}  # a microbatch's activations between the stages
    got, want = np.array(bf16["history"]["loss"]), np.array(fp32["history"]["loss"])
    np.testing.assert_allclose(got, want, **BF16_TRACKS)
    assert not np.array_equal(got, want)
    assert json.loads((out / "run.json").read_text())["config"]["dtype"] == "bfloat16"


def test_bf16_run_samples_and_exports(bf16_run, tmp_path, capsys):
    out = bf16_run[0]
    assert _cli.main(["sample", "--checkpoint", str(out), "--tokens", "6"]) == 0
    assert capsys.readouterr().out.startswith(_sample.DEFAULT_PROMPT)
    assert _cli.main(["export", "--checkpoint", str(out), "--to", str(tmp_path / "hf")]) == 0
    from models import hf

    _, params = hf.load(tmp_path / "hf")
    _assert_trees_close(params, _params(out)[0], rtol=0, atol=0)
