"""Byte tokenizer, seeded batcher and the shipped corpus."""

import numpy as np
import pytest

from models import CORPUS_NAMES, ByteTokenizer, iterate_batches, load_corpus


@pytest.mark.parametrize(
    "text", ["", "hello, world", "héllo wörld — naïve café", "日本語のテキスト", "emoji 🙂\n\ttab"]
)
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, bos=True, eos=True)
    assert ids.dtype == np.int32
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, bos=False)) == text


def test_encode_is_utf8_bytes():
    np.testing.assert_array_equal(ByteTokenizer().encode("é", bos=False), [0xC3, 0xA9])


@pytest.mark.parametrize(("multiple", "size"), [(1, 259), (8, 264), (64, 320), (128, 384)])
def test_vocab_padding(multiple, size):
    tok = ByteTokenizer(multiple=multiple)
    assert tok.vocab_size == size
    assert tok.pad_id < tok.vocab_size


def test_decode_drops_specials_and_padding_ids_and_replaces_bad_bytes():
    tok = ByteTokenizer()
    assert tok.decode([tok.bos_id, 104, 105, tok.pad_id, 263, tok.eos_id]) == "hi"
    assert tok.decode([0xFF, 104]) == "\ufffdh"


@pytest.mark.parametrize("ids", [[-1], [264]])
def test_decode_rejects_out_of_range(ids):
    with pytest.raises(ValueError, match="ids"):
        ByteTokenizer().decode(ids)


def test_bad_multiple():
    with pytest.raises(ValueError, match="multiple"):
        ByteTokenizer(multiple=0)


def _take(seed, n=3):
    tokens = np.arange(1000) % 251
    return list(iterate_batches(tokens, batch_size=4, seq_len=16, seed=seed, num_batches=n))


def test_batches_are_deterministic_per_seed():
    first, again, other = _take(0), _take(0), _take(1)
    assert len(first) == 3
    for (x, y), (x2, y2) in zip(first, again, strict=True):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(first, other, strict=True))


def test_batches_are_shifted_windows():
    for inputs, targets in _take(5):
        assert inputs.shape == targets.shape == (4, 16)
        assert inputs.dtype == targets.dtype == np.int32
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        np.testing.assert_array_equal((inputs + 1) % 251, targets)  # Consecutive tokens.


@pytest.mark.parametrize(
    ("tokens", "kwargs", "match"),
    [
        (np.zeros((2, 50)), {}, "1-D"),
        (np.zeros(16), {}, "at least 17"),
        (np.zeros(50), {"batch_size": 0}, "batch_size"),
        (np.zeros(50), {"num_batches": -1}, "num_batches"),
    ],
)
def test_batcher_rejects_bad_arguments(tokens, kwargs, match):
    args = {"batch_size": 2, "seq_len": 16, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        iterate_batches(tokens, **args)


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_corpus_loads_and_round_trips(name):
    text = load_corpus(name)
    assert len(text) > 4000
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_corpora_are_distinct_and_unknown_name_fails():
    assert "Nevermore" in load_corpus("poe_poems")
    assert "Nevermore" not in load_corpus("shakespeare_sonnets")
    with pytest.raises(ValueError, match="shakespeare_sonnets"):
        load_corpus("hamlet")
