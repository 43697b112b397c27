"""execution.scan_layers (moe/model.py) against the unrolled loop: values, aux outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import model as layer_scan
from moe.decoding.generate import init_cache
from moe.model import runs_of_equal_blocks, scan_blocks
from tests.model_fixtures import TINY, ragged_execution, tiny_model

# 5 layers: one dense, four MoE (one scanned run of 4); the interleaved family alternates dense and MoE.
DEEP = dict(n_layers=5)


def test_runs_group_consecutive_blocks_of_one_structure():
    assert runs_of_equal_blocks(tiny_model(**DEEP).blocks) == [(0, 1), (1, 5)]
    interleaved = tiny_model(n_layers=5, first_k_dense=0, moe_layer_step=2)  # dense, MoE, dense, MoE, dense
    assert runs_of_equal_blocks(interleaved.blocks) == [(i, i + 1) for i in range(5)]
    two_runs = tiny_model(n_layers=6, first_k_dense=2, dense_layers="4,5")  # dense x2, MoE x2, dense x2
    assert runs_of_equal_blocks(two_runs.blocks) == [(0, 2), (2, 4), (4, 6)]


def _loss_and_grads(model, tokens, seg, ex):
    def loss(m):
        logits, aux = m(tokens, execution=ex, segment_ids_BxL=seg, return_routing=True, return_hidden=True)
        return jnp.mean(jnp.sin(logits)) + aux["balance_loss"], (logits, aux)

    (_, out), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    return out, jax.tree.leaves(nnx.state(grads, nnx.Param))


@pytest.fixture(scope="module")
def loop_reference():
    """The model, its inputs and the unrolled loop's values and gradients without remat: remat changes no value
    (tests/test_model.py compares it on the loop), so every remat mode's scan is held to this one reference."""
    model = tiny_model(**DEEP)
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, TINY["vocab_size"])
    seg = jnp.asarray([[1] * 9, [1] * 6 + [0] * 3])
    return model, tokens, seg, _loss_and_grads(model, tokens, seg, ragged_execution(scan_layers=False))


@pytest.mark.parametrize("remat", [False, "full", "save_moe"])
def test_scanned_layers_equal_the_loop_values_and_gradients(remat, loop_reference, monkeypatch):
    model, tokens, seg, ((want_logits, want_aux), want_grads) = loop_reference
    # The four MoE blocks really run as one scan when the model is merged from its state inside a traced function,
    # as the train step builds it (were their graphdefs to compare unequal there, they would run unrolled and the
    # comparisons below would hold trivially).
    scanned = []
    monkeypatch.setattr(layer_scan, "scan_blocks",
                        lambda call, blocks, *a: scanned.append(len(blocks)) or scan_blocks(call, blocks, *a))
    graphdef, state = nnx.split(model)
    jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens, execution=ragged_execution(scan_layers=True)))(state)
    assert scanned == [4]
    scanned.clear()
    ex = ragged_execution(remat=bool(remat), remat_policy=remat or "full", scan_layers=True)
    (got_logits, got_aux), got_grads = _loss_and_grads(model, tokens, seg, ex)
    assert scanned == [4]  # and so is the compared run (remat included)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-6)
    for key in ("balance_loss", "expert_load", "dropped_frac"):
        np.testing.assert_allclose(got_aux[key], want_aux[key], rtol=1e-5, atol=1e-7)
    assert len(got_aux["routing"]) == 4 and len(got_aux["hidden"]) == DEEP["n_layers"] + 1
    for got, want in zip(got_aux["routing"], want_aux["routing"], strict=True):
        np.testing.assert_array_equal(got["expert_ids"], want["expert_ids"])
        np.testing.assert_allclose(got["gates"], want["gates"], rtol=1e-5, atol=1e-7)
    for got, want in zip(got_aux["hidden"], want_aux["hidden"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(got_grads) == len(want_grads)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


def test_scanned_layers_return_each_layers_attention_and_decode_unrolled():
    """Attention maps come back one per layer; with a KV cache the blocks run one by one (same logits)."""
    model = tiny_model(**DEEP)
    tokens = jax.random.randint(jax.random.key(4), (1, 6), 0, TINY["vocab_size"])
    scan, loop = ragged_execution(scan_layers=True), ragged_execution()
    attention = nnx.jit(lambda m, t, ex: m(t, execution=ex, return_attention=True)[1]["attention"], static_argnums=2)
    got, want = attention(model, tokens, scan), attention(model, tokens, loop)
    assert len(got) == DEEP["n_layers"]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    cache = init_cache(model.cfg, 1, 8)
    logits, _ = nnx.jit(lambda m, t, c: m(t, execution=scan, cache=c, cache_index=0))(model, tokens, cache)
    np.testing.assert_allclose(logits, nnx.jit(lambda m, t: m(t, execution=loop)[0])(model, tokens), rtol=1e-5,
                               atol=1e-5)
