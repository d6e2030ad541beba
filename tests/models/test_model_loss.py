"""`cross_entropy_loss` against a NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import cross_entropy_loss


def _reference(logits, targets):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]


@pytest.mark.parametrize(("dtype", "rtol"), [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-6)])
def test_matches_reference(dtype, rtol):
    logits = (3 * jax.random.normal(jax.random.key(0), (2, 5, 11))).astype(dtype)
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 11)
    loss = cross_entropy_loss(logits, targets)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    expected = _reference(logits.astype(jnp.float32), targets).mean()
    np.testing.assert_allclose(loss, expected, rtol=rtol)


def test_mask_weights_tokens():
    logits = jax.random.normal(jax.random.key(0), (2, 4, 7))
    targets = jnp.arange(8).reshape(2, 4) % 7
    mask = jnp.array([[1, 1, 0, 0], [1, 0, 0, 0]])
    per_token = _reference(logits, targets)
    expected = per_token[np.asarray(mask, bool)].mean()
    np.testing.assert_allclose(cross_entropy_loss(logits, targets, mask), expected, rtol=1e-6)
    assert float(cross_entropy_loss(logits, targets, jnp.zeros((2, 4)))) == 0.0


def test_shape_mismatch():
    with pytest.raises(ValueError, match="targets"):
        cross_entropy_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="mask"):
        cross_entropy_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3), jnp.int32), jnp.ones(3))
