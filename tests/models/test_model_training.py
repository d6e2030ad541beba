"""A few AdamW steps on the corpus lower the loss of the tiny models."""

import jax
import numpy as np
import optax
import pytest

from models import (
    ByteTokenizer,
    cross_entropy_loss,
    get_config,
    iterate_batches,
    load_corpus,
    make_model,
)


@pytest.mark.parametrize(
    "config",
    [get_config("gpt-tiny", dropout_rate=0.1), get_config("llama-tiny")],
    ids=["gpt", "llama"],
)
def test_adamw_steps_reduce_loss(config):
    model = make_model(config)
    tokens = ByteTokenizer().encode(load_corpus("shakespeare_sonnets"))
    batches = list(iterate_batches(tokens, batch_size=8, seq_len=64, seed=0, num_batches=15))
    params = jax.jit(model.init)(jax.random.key(0), batches[0][0])["params"]
    optimizer = optax.adamw(3e-3, weight_decay=0.01)

    def loss_fn(params, inputs, targets, rng):
        logits = model.apply({"params": params}, inputs, deterministic=False, rngs={"dropout": rng})
        return cross_entropy_loss(logits, targets)

    @jax.jit
    def train_step(params, opt_state, inputs, targets, rng):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, rng)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    losses = []
    for step, (inputs, targets) in enumerate(batches):
        params, opt_state, loss = train_step(
            params, opt_state, inputs, targets, jax.random.key(step)
        )
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[0] > 5.0  # About log(264) at initialisation.
    assert np.mean(losses[-3:]) < losses[0] - 1.5
