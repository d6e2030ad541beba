"""``mmflax train --dataset``: reading, packing, caching, the grain stream and resuming it.

The unit tests run on small files and need no compiler. The CLI test trains the tiny GPT on
a JSONL file (the Poe poems cut into documents) with a held-out split, and checks that 2
steps plus 2 resumed steps give the losses, evaluations and parameters of 4 uninterrupted
ones, bit for bit. Bad files are in the catalogue of ``tests/test_bad_inputs.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from models import ByteTokenizer, load_corpus
from multimesh_flax.checkpoint import Checkpointer
from multimesh_flax.cli import _cli, _data, _text_files, _token_cache
from multimesh_flax.cli.errors import DataFileError, DataSizeError

TOK = ByteTokenizer()
EOS = TOK.eos_id


def _documents():
    return [d for d in load_corpus("poe_poems").split("\n\n") if d.strip()]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """The Poe poems as a JSONL file, one stanza per line (31 documents, 8 kB)."""
    path = tmp_path_factory.mktemp("data") / "poe.jsonl"
    path.write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(_documents()))
    )
    return path


def _ids(text):
    return TOK.encode(text, bos=False, eos=True).tolist()


# --- reading ---------------------------------------------------------------------------------


def test_each_format_reads_the_same_documents(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    docs = ["first doc", "zweites Dokument: ü", "third\nwith a line break"]
    (tmp_path / "one.txt").write_text(docs[0])
    (tmp_path / "lines.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs) + "\n\n")
    pq.write_table(pa.table({"body": docs}), tmp_path / "table.parquet", row_group_size=2)
    read = {p.name: list(_text_files.read_documents(p, "body")) for p in tmp_path.iterdir()}
    assert read == {"one.txt": docs[:1], "lines.jsonl": docs, "table.parquet": docs}
    assert [p.name for p in _text_files.find_files(tmp_path)] == sorted(read)
    nested = tmp_path / "sub"
    nested.mkdir()
    (nested / "a.jsonl").write_text(json.dumps({"body": "x"}))
    (nested / "skip.csv").write_text("not read")
    assert [p.name for p in _text_files.find_files(nested)] == ["a.jsonl"]


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("empty.txt", b"", "empty file"),
        ("blank.jsonl", b"\n\n", "empty file"),
        ("binary.txt", b"\x89PNG\r\n\x1a\n\x00\x00", "byte 0x89 at offset 0"),
        ("nul.txt", b"text\x00more", "byte 0x00 at offset 4"),
        ("field.jsonl", b'{"text": "a"}\n{"content": "b"}\n', "line 2 .* got \\['content'\\]"),
        ("list.jsonl", b'["text"]\n', "line 1 .* got list"),
        ("broken.jsonl", b'{"text": \n', "JSON object on line 1"),
        ("latin1.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1"), "line 1.*byte 0xe9"),
        ("data.csv", b"a,b\n", "got '.*data.csv' \\(.csv\\)"),
    ],
)
def test_unreadable_files_are_refused_naming_the_file(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataFileError, match=match):
        for file in _text_files.find_files(path):
            list(_text_files.read_documents(file, "text"))


def test_missing_unreadable_and_empty_folders_are_refused(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        _text_files.find_files(tmp_path / "nothing.jsonl")
    with pytest.raises(DataFileError, match="found none"):
        _text_files.find_files(tmp_path)
    folder = tmp_path / "folder.txt"  # cannot be read as a file, even by root
    folder.mkdir()
    with pytest.raises(DataFileError, match="Cannot read .*folder.txt' .*Is a directory"):
        list(_text_files.read_documents(folder, "text"))


# --- tokens: packing and the cache -----------------------------------------------------------


def test_documents_are_packed_with_an_end_of_text_id_between_them(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "ab"}) + "\n" + json.dumps({"text": "cde"})
    )
    (tmp_path / "b.txt").write_text("fg")
    files = _text_files.find_files(tmp_path)
    tokens = _token_cache.load_tokens(files, TOK, "text", tmp_path / "cache")
    assert tokens.ids.tolist() == _ids("ab") + _ids("cde") + _ids("fg")
    assert tokens.documents == 3 and tokens.ids.dtype == np.uint16
    data = _data.TextData(tokens.ids, seq_len=3)  # 10 tokens: 2 windows of 4, 2 left over
    assert data.windows.tolist() == [_ids("ab") + [ord("c")], [ord("d"), ord("e"), EOS, ord("f")]]
    assert data.tail_tokens == 2 and data.describe()["tail_tokens_unused"] == 2
    assert np.shares_memory(data.windows, tokens.ids)  # a view of the memory map, no copy


def test_the_cache_is_reused_until_a_file_or_the_tokenizer_changes(tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_text("hello")
    cache = tmp_path / "run" / "data_cache"
    first = _token_cache.load_tokens([source], TOK, "text", cache)
    assert first.rebuilt and first.ids.tolist() == _ids("hello")
    again = _token_cache.load_tokens([source], TOK, "text", cache)
    assert not again.rebuilt and again.key == first.key and again.ids.tolist() == _ids("hello")

    source.write_text("hello, world")  # another size and mtime: rebuilt, the old one removed
    changed = _token_cache.load_tokens([source], TOK, "text", cache)
    assert changed.rebuilt and changed.key != first.key
    assert changed.ids.tolist() == _ids("hello, world")
    assert sorted(p.name for p in cache.iterdir()) == [changed.key]

    stat = source.stat()  # same size, new mtime: rebuilt
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert _token_cache.load_tokens([source], TOK, "text", cache).rebuilt
    other = _token_cache.load_tokens([source], ByteTokenizer(multiple=128), "text", cache)
    assert other.rebuilt and other.key != changed.key
    from models import hf

    gpt2 = hf.HFTokenizer.from_folder(Path(__file__).parent / "fixtures" / "hf" / "gpt2")
    learned = _token_cache.load_tokens([source], gpt2, "text", cache)
    assert learned.rebuilt and learned.key != other.key
    assert learned.ids.tolist() == gpt2.encode("hello, world", bos=False, eos=True).tolist()


def test_a_refused_build_leaves_nothing_behind(tmp_path):
    good, bad = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("fine")
    bad.write_bytes(b"\xff\xfe")
    cache = tmp_path / "run" / "data_cache"
    with pytest.raises(DataFileError, match="b.txt"):
        _token_cache.load_tokens([good, bad], TOK, "text", cache)
    assert not (tmp_path / "run").exists()

    def refuse(count):
        raise DataSizeError(f"{count} tokens")

    with pytest.raises(DataSizeError, match="5 tokens"):
        _token_cache.load_tokens([good], TOK, "text", cache, check=refuse)
    assert not (tmp_path / "run").exists()


def test_too_small_corpora_and_empty_eval_splits_are_refused():
    _data.check_sizes(8 * 33, seq_len=32, batch_size=8, eval_fraction=None)
    with pytest.raises(DataSizeError, match="got 263 tokens: 7 training windows"):
        _data.check_sizes(8 * 33 - 1, seq_len=32, batch_size=8, eval_fraction=None)
    with pytest.raises(DataSizeError, match="holds out no window"):
        _data.check_sizes(100 * 33, seq_len=32, batch_size=8, eval_fraction=0.001)
    with pytest.raises(DataSizeError, match="after holding out 50"):
        _data.check_sizes(100 * 33, seq_len=32, batch_size=64, eval_fraction=0.5)


# --- the stream ------------------------------------------------------------------------------


def _data_of(count, seq_len=3, fraction=None):
    return _data.TextData(np.arange(count * (seq_len + 1), dtype=np.int32), seq_len, fraction)


def _first_tokens(batches):
    return [b["inputs"][:, 0].tolist() for b in batches]


def test_the_held_out_split_is_spread_over_the_corpus_and_never_trained_on():
    data = _data_of(2500, fraction=0.1)  # blocks of 1000 windows, the last 100 of each held out
    assert (data.train_count, data.held_out_count) == (2300, 200)
    train = data.train_window(np.arange(data.train_count))
    held = data.held_out_window(np.arange(data.held_out_count))
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(2500))
    assert held.tolist() == [*range(900, 1000), *range(1900, 2000)]
    stream = data.train_stream(batch_size=100, seed=3)
    seen = np.concatenate([next(stream)["inputs"][:, 0] // 4 for _ in range(23)])
    assert sorted(seen.tolist()) == sorted(train.tolist())  # one epoch: every window once


def test_epochs_reshuffle_and_carry_the_remainder_into_the_next_batch():
    data = _data_of(10)
    stream = data.train_stream(batch_size=4, seed=0)
    first = np.concatenate([next(stream)["inputs"][:, 0] // 4 for _ in range(5)])  # 2 epochs
    assert sorted(first[:10].tolist()) == sorted(first[10:].tolist()) == list(range(10))
    assert first[:10].tolist() != first[10:].tolist()


def _take(stream, count):
    return [next(stream) for _ in range(count)]


def test_the_stream_is_deterministic_and_resumes_where_it_stopped():
    data = _data_of(50, fraction=0.2)
    expected = _take(data.train_stream(batch_size=4, seed=7), 30)  # several epochs
    assert _first_tokens(_take(data.train_stream(batch_size=4, seed=7), 30)) == _first_tokens(
        expected
    )
    assert _first_tokens(_take(data.train_stream(batch_size=4, seed=8), 3)) != _first_tokens(
        expected[:3]
    )
    interrupted = data.train_stream(batch_size=4, seed=7)
    _take(interrupted, 17)
    state = json.loads(json.dumps(interrupted.get_state()))  # as checkpoint metadata holds it
    resumed = data.train_stream(batch_size=4, seed=7)
    resumed.set_state(state)
    for want, got in zip(expected[17:], _take(resumed, 13), strict=True):
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])


def test_eval_batches_cover_the_held_out_windows_once():
    data = _data_of(100, fraction=0.25)
    batches = data.eval_batches(batch_size=8)
    assert [valid for _, valid in batches] == [8, 8, 8, 1]
    rows = np.concatenate([b["inputs"][:valid, 0] // 4 for b, valid in batches])
    assert rows.tolist() == data.held_out_window(np.arange(25)).tolist()


def test_each_process_reads_the_rows_its_devices_hold():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.pipeline import make_multimesh

    multi = make_multimesh(4, 2, 1)  # 4 stages; pretend processes own 2 devices each
    stage = [multi.slice(stage=s) for s in range(4)]
    inputs, targets = NamedSharding(stage[0], P()), NamedSharding(stage[3], P())
    process_of = lambda device: device.id // 2  # noqa: E731
    rows = [_data.rows_of_process([inputs, targets], (8, 5), p, process_of) for p in range(4)]
    assert [r.tolist() for r in rows] == [list(range(8)), [], [], list(range(8))]
    split = NamedSharding(stage[0], P("data"))  # a batch split over data across processes
    halves = [_data.rows_of_process([split], (8, 5), p, lambda d: d.id) for p in (0, 1)]
    assert [h.tolist() for h in halves] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    data = _data_of(40)
    only = data.train_stream(batch_size=8, seed=1, rows=halves[1])
    whole = next(data.train_stream(batch_size=8, seed=1))
    part = next(only)
    np.testing.assert_array_equal(part["inputs"][4:], whole["inputs"][4:])
    assert not part["inputs"][:4].any()  # rows of other processes are not read
    placed = _data.place_batch(whole, {"inputs": split, "targets": split})
    np.testing.assert_array_equal(np.asarray(placed["inputs"]), whole["inputs"])
    assert placed["inputs"].sharding == split


# --- the command line ------------------------------------------------------------------------

TRAIN = [
    "train",
    *("--batch-size", "8", "--seq-len", "32", "--warmup", "2", "--log-every", "1"),
    *("--eval-fraction", "0.1", "--eval-every", "2"),
    "--no-samples",
]


def _train(out, *extra):
    assert _cli.main([*TRAIN, "--out", str(out), *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


def _params(out):
    with Checkpointer(out / "checkpoint", read_only=True) as ckpt:
        return jax.tree.leaves(jax.tree.map(np.asarray, ckpt.restore()))


@pytest.mark.heavy
def test_train_on_jsonl_with_eval_and_resume_matches_the_uninterrupted_run(jsonl, tmp_path, capsys):
    """4 steps saving at step 2; then the run as a kill after that save leaves it (step 4's
    checkpoint gone), resumed: the same losses, evaluations and parameters, bit for bit."""
    whole = tmp_path / "whole"
    metrics = _train(whole, "--dataset", str(jsonl), "--steps", "4", "--save-every", "2")
    captured = capsys.readouterr()
    assert "31 documents" in captured.out and "tokenized into" in captured.out
    assert "eval_loss=" in captured.err and "eval_ppl=" in captured.err  # the progress bar
    assert (whole / "loss.png").read_bytes().startswith(b"\x89PNG")
    evals = metrics["eval_history"]
    assert evals["step"] == [0, 2, 4] and evals["loss"][-1] < evals["loss"][0]
    np.testing.assert_allclose(evals["perplexity"], np.exp(evals["loss"]), rtol=1e-12)
    assert metrics["summary"]["last_eval_loss"] == evals["loss"][-1]
    assert metrics["summary"]["eval_programs"] == 1  # three evaluations, one program
    assert metrics["data"]["held_out_windows"] == 25 and metrics["data"]["train_windows"] == 227
    with Checkpointer(whole / "checkpoint", read_only=True) as ckpt:
        assert ckpt.metadata(2)["data"]["iterator"] == {"next_index": 2}
        assert ckpt.metadata(4)["data"]["iterator"] == {"next_index": 4}

    part = tmp_path / "part"
    shutil.copytree(whole, part, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(part / "checkpoint" / "4")
    resumed = _train(part, "--resume")  # the 2 steps left; keeps the dataset and eval settings
    stdout = capsys.readouterr().out
    assert "resumed step 2" in stdout and "reusing the tokens cached" in stdout
    assert resumed["history"]["step"] == [1, 2, 3, 4]
    assert resumed["history"]["loss"] == metrics["history"]["loss"]  # bit for bit
    assert resumed["eval_history"] == evals
    for a, b in zip(_params(part), _params(whole), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "given, match",
    [
        ({"dataset": "a.jsonl", "corpus": "poe_poems"}, "both choose the training text"),
        ({"dataset": "a.jsonl", "eval_fraction": 0.0}, "strictly between 0 and 1 .*got 0.0"),
        ({"dataset": "a.jsonl", "eval_fraction": 1.0}, "strictly between 0 and 1 .*got 1.0"),
        ({"dataset": "a.jsonl", "eval_every": 5}, "no `--eval-fraction`"),
        ({"dataset": "a.jsonl", "eval_fraction": 0.1, "eval_every": 0}, "`--eval-every`"),
    ],
)
def test_contradicting_data_options_are_refused(tmp_path, given, match):
    from multimesh_flax.cli import _run_options
    from multimesh_flax.cli.errors import RunOptionError

    with pytest.raises(RunOptionError, match=match):
        options = _run_options.resolve_options({"out": str(tmp_path / "run"), **given})
        _run_options.check_options(options, 8)
    assert not (tmp_path / "run").exists()
