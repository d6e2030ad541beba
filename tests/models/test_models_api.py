"""The public names of `models` (its docstring examples run through `--doctest-modules`)."""

import models


def test_public_names():
    assert sorted(models.__all__) == sorted(
        [
            "CORPUS_NAMES",
            "PRESETS",
            "ByteTokenizer",
            "Family",
            "GPT",
            "GPTBlock",
            "GPTEmbed",
            "GPTHead",
            "Llama",
            "LlamaBlock",
            "LlamaEmbed",
            "LlamaHead",
            "ModelConfig",
            "cross_entropy_loss",
            "generate",
            "get_config",
            "init_cache",
            "iterate_batches",
            "load_corpus",
            "make_model",
        ]
    )
    for name in models.__all__:
        assert getattr(models, name) is not None
