"""``mmflax train --init-from`` and ``mmflax export`` on the Hugging Face fixtures.

One tiny fine-tuning run of the GPT-2 fixture (4 stages, its BPE tokenizer) is shared by the
tests: its first loss must be the loss of the checkpoint's own parameters on the first batch
(computed by the unstaged model under plain ``jax.jit``), and its export must hold exactly
the reference tensors and read back bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors

from models import cross_entropy_loss, hf, make_model
from multimesh_flax.cli import _cli, _recipe, _sample

# One worker runs these tests (dev.py's --dist loadgroup): they share the two fine-tuning runs.
pytestmark = pytest.mark.xdist_group("test_cli_pretrained")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
TINY = ["--batch-size", "8", "--seq-len", "32", "--warmup", "1", "--log-every", "1"]
LAYOUT = ["--stages", "4", "--data", "2", "--tensor", "1"]
STEPS = 3


def _main(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrained") / "run"
    init = str(FIXTURES / "gpt2")
    code, stdout, stderr = _main(
        "train", "--init-from", init, "--out", str(out), "--steps", str(STEPS), *TINY, *LAYOUT
    )
    assert code == 0, stderr
    return out, json.loads((out / "metrics.json").read_text()), stdout


def _keys_and_shapes(folder):
    shapes = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safetensors.safe_open(str(file), framework="np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def test_fine_tuning_starts_from_the_checkpoint_with_its_tokenizer(run):
    out, metrics, stdout = run
    assert "gpt2 on 4x2x1" in stdout
    assert metrics["options"]["init_from"] == str(FIXTURES / "gpt2")
    tokenizer = hf.HFTokenizer.from_folder(FIXTURES / "gpt2")
    tokens = _recipe.corpus_tokens("shakespeare_sonnets", tokenizer)
    batch = next(_recipe.batch_stream(tokens, 8, 32, seed=0))
    config, params = hf.load(FIXTURES / "gpt2")

    @jax.jit
    def loss(p, b):
        return cross_entropy_loss(
            make_model(config).apply({"params": p}, b["inputs"]), b["targets"]
        )

    np.testing.assert_allclose(metrics["history"]["loss"][0], float(loss(params, batch)), rtol=1e-5)
    assert metrics["history"]["loss"][-1] < metrics["history"]["loss"][0]
    sample = metrics["samples"]["after"]["texts"]["greedy"]
    assert sample.startswith(_sample.DEFAULT_PROMPT)

    out = run[0]
    code, text, stderr = _main("sample", "--checkpoint", str(out), "--tokens", "5", "--seed", "1")
    assert code == 0, stderr
    assert text.startswith(_sample.DEFAULT_PROMPT) and len(text.strip()) > len("Shall I")
    code, _, stderr = _main("sample", "--checkpoint", str(out), "--tokens", "100")
    prompt_ids = len(tokenizer.encode(_sample.DEFAULT_PROMPT))
    assert code == 2 and f"between 0 and {64 - prompt_ids}" in stderr  # BPE ids, not bytes


def test_export_writes_the_reference_tensors_and_reads_back_bit_exact(run, tmp_path):
    out = run[0]
    code, stdout, stderr = _main("export", "--checkpoint", str(out), "--to", str(tmp_path / "hf"))
    assert code == 0, stderr
    folder = tmp_path / "hf"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert _keys_and_shapes(folder) == _keys_and_shapes(FIXTURES / "gpt2")
    config, trained, _ = _sample.restore_params(out)
    exported_config, exported = hf.load(folder)
    assert exported_config == config
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(exported), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert json.loads((folder / "config.json").read_text())["bos_token_id"] == 0

    code, _, stderr = _main("export", "--checkpoint", str(out), "--to", str(folder))
    assert code == 2 and "already exists. Choose another `--to`" in stderr


BAD = {
    "model_and_init_from": (["--model", "gpt-tiny"], "both choose the model"),
    "layers_differ": (["--layers", "2"], "differs from the 4 layers"),
    "stages_do_not_divide": (["--stages", "3"], "does not divide the 4 layers"),
}


@pytest.mark.parametrize("extra, match", BAD.values(), ids=BAD.keys())
def test_bad_fine_tuning_options_exit_2(extra, match, tmp_path):
    argv = ["train", "--init-from", str(FIXTURES / "gpt2"), "--out", str(tmp_path / "r"), *extra]
    code, _, stderr = _main(*argv)
    assert code == 2 and match in stderr, stderr
    assert list(tmp_path.iterdir()) == []


def test_init_from_a_folder_without_config_exits_2(tmp_path):
    code, _, stderr = _main("train", "--init-from", str(tmp_path), "--out", str(tmp_path / "r"))
    assert code == 2 and "config.json" in stderr


# --- a Qwen3 checkpoint (per-head q/k norms, head_dim != width / heads) on a tensor axis ----

QWEN3_LAYOUT = ["--stages", "2", "--data", "2", "--tensor", "2"]


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3") / "run"
    init = str(FIXTURES / "qwen3")
    code, stdout, stderr = _main(
        *("train", "--init-from", init, "--out", str(out), "--steps", "2", *TINY, *QWEN3_LAYOUT),
        "--no-samples",
    )
    assert code == 0, stderr
    return out, json.loads((out / "metrics.json").read_text())


def test_fine_tuning_qwen3_starts_from_the_checkpoint(qwen3_run):
    _, metrics = qwen3_run
    tokenizer = hf.HFTokenizer.from_folder(FIXTURES / "qwen3")
    tokens = _recipe.corpus_tokens("shakespeare_sonnets", tokenizer)
    batch = next(_recipe.batch_stream(tokens, 8, 32, seed=0))
    config, params = hf.load(FIXTURES / "qwen3", dtype=np.float32)
    assert config.qk_norm and config.head_dim == 16
    logits = jax.jit(make_model(config).apply)({"params": params}, batch["inputs"])
    want = float(cross_entropy_loss(logits, batch["targets"]))
    losses = metrics["history"]["loss"]
    np.testing.assert_allclose(losses[0], want, rtol=1e-5)
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert metrics["samples"] == {"before": None, "after": None}  # --no-samples
    assert not (qwen3_run[0] / "samples.txt").exists()


def test_export_of_fine_tuned_qwen3_is_a_qwen3_folder(qwen3_run, tmp_path):
    out = qwen3_run[0]
    folder = tmp_path / "hf"
    code, _, stderr = _main("export", "--checkpoint", str(out), "--to", str(folder))
    assert code == 0, stderr
    assert (folder / "tokenizer.json").is_file()
    # Fine-tuning moved the (tied) table and head apart: the export has its own lm_head.
    reference = _keys_and_shapes(FIXTURES / "qwen3")
    reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    assert _keys_and_shapes(folder) == reference
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3ForCausalLM"] and saved["head_dim"] == 16
    assert saved["tie_word_embeddings"] is False
    config, trained, _ = _sample.restore_params(out)
    exported_config, exported = hf.load(folder)
    assert exported_config == config
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(exported), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_fine_tuning_mistral_past_its_sliding_window_exits_2(tmp_path):
    init = str(FIXTURES / "mistral")
    argv = ["train", "--init-from", init, "--out", str(tmp_path / "r"), "--steps", "1", *TINY]
    code, _, stderr = _main(*argv, *LAYOUT)  # --seq-len 32, window 16
    assert code == 2 and "`sliding_window` is 16" in stderr, stderr
