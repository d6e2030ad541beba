"""Units of the reference models and of a user's model by patterns; errors for bad patterns."""

import jax.numpy as jnp
import pytest
from flax import linen as nn

from models import GPT, Llama, get_config
from multimesh_flax import errors
from multimesh_flax.planner import find_units
from tests.planner._planning_models import MLP, tokens

pytestmark = pytest.mark.xdist_group("planner")


@pytest.mark.parametrize("family, preset", [(GPT, "gpt-tiny"), (Llama, "llama-tiny")])
def test_reference_models_have_stem_blocks_head(family, preset):
    found = find_units(family(get_config(preset, num_layers=3)), tokens())
    assert [(i.path, i.role) for i in found.instances] == [
        ("stem", "stem"),
        ("blocks_0", "layer"),
        ("blocks_1", "layer"),
        ("blocks_2", "layer"),
        ("head", "head"),
    ]
    assert [u.kind for u in found.units] == [
        f"{family.__name__}{k}" for k in ("Embed", "Block", "Head")
    ]
    assert len({i.unit for i in found.layers}) == 1  # identical blocks: one unit


def test_user_patterns_match_paths_and_group_by_structure():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, name="inp")(x)
            for i in range(3):
                x = nn.Dense(16, name=f"layer_{i}")(x)
            return nn.Dense(4, name="out")(x)

    found = find_units(
        Net(), jnp.ones((2, 8)), patterns=[("stem", "inp"), r"layer_\d+", ("head", "out")]
    )
    assert [(i.path, i.role, i.unit) for i in found.instances] == [
        ("inp", "stem", 0),
        ("layer_0", "layer", 1),
        ("layer_1", "layer", 1),
        ("layer_2", "layer", 1),
        ("out", "head", 2),
    ]


def test_layers_of_another_width_are_another_unit():
    class Funnel(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i, width in enumerate((16, 16, 8)):
                x = nn.Dense(width, name=f"layer_{i}")(x)
            return x

    found = find_units(Funnel(), jnp.ones((2, 16)), patterns=[r"layer_\d+"])
    assert [i.unit for i in found.instances] == [0, 0, 1]


@pytest.mark.parametrize(
    "patterns, fragment",
    [
        (None, "Expected `patterns`"),
        ([r"block_\d+"], "matched none"),
        (["layer_("], "regular expressions"),
        ([("tail", r"layer_\d+")], "Expected a role"),
        ([("head", "layer_0"), r"layer_[123]"], "stems first and the heads last"),
    ],
)
def test_bad_patterns_raise(patterns, fragment):
    with pytest.raises(errors.UnitPatternError, match=fragment.replace("`", ".")):
        find_units(MLP(), jnp.ones((2, 16)), patterns=patterns)
