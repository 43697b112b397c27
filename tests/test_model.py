"""Whole-model properties: routing capture, accounting against the real parameter tree, remat == no remat (every
policy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import Execution, param_counts, router, train_flops_per_token
from moe.dispatch import experts
from moe.dispatch.execution import REMAT_POLICIES
from tests.model_fixtures import TINY, ragged_execution, tiny_model


def test_routing_capture_shapes_and_load():
    model = tiny_model()
    cfg = model.cfg
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    seg = jnp.asarray([[1] * 9, [1] * 6 + [0] * 3])  # three padding tokens
    _, aux = nnx.jit(lambda m, t, s: m(t, segment_ids_BxL=s, return_routing=True))(model, tokens, seg)
    routing = aux["routing"]
    assert len(routing) == cfg.n_moe_layers
    E, K = cfg.n_routed_experts, cfg.top_k
    for r, load in zip(routing, aux["expert_load"]):
        assert r["expert_ids"].shape == (2, 9, K) and r["gates"].shape == (2, 9, K)
        assert r["scores"].shape == (2, 9, E)
        assert float(load.sum()) == 15 * K  # padding is not counted
        np.testing.assert_allclose(np.asarray(r["gates"]).sum(-1), cfg.routed_scaling_factor, rtol=1e-5)


def test_param_counts_match_the_tree():
    for tie in (False, True):
        model = tiny_model(tie_embeddings=tie)
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert param_counts(model.cfg)["total"] == n
        assert param_counts(model.cfg)["active"] < n
    assert train_flops_per_token(tiny_model().cfg, 128) > 6 * param_counts(tiny_model().cfg)["active"] * 0.5


def _loss_and_state(tokens, ex):
    model = tiny_model()
    graphdef, state = nnx.split(model)

    def loss(state):
        logits, aux = nnx.merge(graphdef, state)(tokens, execution=ex)
        return logits.mean() + aux["balance_loss"]
    return loss, state


@pytest.mark.parametrize("policy,dispatch", [*((p, "dropless") for p in REMAT_POLICIES), ("save_moe", "capacity"),
                                             ("save_moe", "expert_parallel_dropless")])
def test_remat_gives_identical_gradients(policy, dispatch):
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, TINY["vocab_size"])

    def grads(ex):
        loss, state = _loss_and_state(tokens, ex)
        return jax.tree.leaves(jax.jit(jax.grad(loss))(state))

    plain = grads(ragged_execution(dispatch=dispatch))
    for a, b in zip(plain, grads(ragged_execution(dispatch=dispatch, remat=True, remat_policy=policy)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dispatch", ["dropless", "expert_parallel_dropless"])
def test_permute_grad_gather_gives_the_scatter_gradients(dispatch, remat=True):
    """execution.permute_grad (auto: scatter on CPU, gather on GPUs) moves rows backward by gathers or by
    scatter-adds: the same gradients through the whole model, under save_moe's kept residuals (the custom VJPs'
    residuals among them)."""
    tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, TINY["vocab_size"])

    def grads(permute):
        loss, state = _loss_and_state(tokens, ragged_execution(dispatch=dispatch, permute_grad=permute, remat=remat,
                                                               remat_policy="save_moe"))
        scatter_adds = str(jax.make_jaxpr(jax.grad(loss))(state)).count("scatter-add")
        return jax.tree.leaves(jax.jit(jax.grad(loss))(state)), scatter_adds

    assert experts.permute_for("auto") == ("scatter" if jax.default_backend() == "cpu" else "gather")
    (scattered, n_scatter), (gathered, n_gather) = grads("scatter"), grads("gather")
    assert n_gather < n_scatter  # the setting reaches the MoE layers: their row scatter-adds are gone
    for a, b in zip(scattered, gathered, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dispatch,grouped,expert_op", [("dropless", "ragged_dot", "ragged_dot_general["),
                                                        ("dropless", "slab", "cond["),
                                                        ("expert_parallel_dropless", "ragged_dot",
                                                         "ragged_dot_general[")])
def test_save_moe_remat_reruns_no_routed_expert_work(dispatch, grouped, expert_op):
    """remat_policy=save_moe keeps the routed experts' residuals: its gradient program runs the experts' matmuls
    (ragged_dot; slab's layout switch) and the sorts as often as without remat, where full remat runs them again."""
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, TINY["vocab_size"])

    def counts(**remat):
        loss, state = _loss_and_state(tokens, Execution(dispatch=dispatch, grouped_matmul=grouped, **remat))
        program = str(jax.make_jaxpr(jax.grad(loss))(state))
        return program.count(expert_op), program.count("sort["), program.count("dot_general")

    plain, full, save_moe = counts(), counts(remat=True), counts(remat=True, remat_policy="save_moe")
    assert save_moe[:2] == plain[:2]
    assert full[0] > plain[0] and full[1] > plain[1]
    assert plain[2] < save_moe[2] < full[2]  # attention, router and shared experts are still recomputed


def test_forward_exposes_hidden_states_and_attention():
    """Analysis reads the model's own forward: the residual stream after the embedding and every block, whose
    last entry unembeds to the logits, and one attention map per layer whose rows sum to 1."""
    model = tiny_model()
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, TINY["vocab_size"])

    @nnx.jit
    def forward(m, t):
        logits, aux = m(t, execution=ragged_execution(), return_hidden=True, return_attention=True)
        return logits, aux, m.unembed(aux["hidden"][-1]), m.embed_tokens(t)

    logits, aux, unembedded, embedded = forward(model, tokens)
    assert len(aux["hidden"]) == TINY["n_layers"] + 1 and len(aux["attention"]) == TINY["n_layers"]
    np.testing.assert_allclose(unembedded, logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(embedded, aux["hidden"][0])
    np.testing.assert_allclose(aux["attention"][0].sum(-1), 1.0, rtol=1e-5)


def test_save_moe_backward_uses_the_forwards_routing(monkeypatch):
    """If the router rerun in the backward pass chose differently (bf16 recomputed on a GPU may flip a near tie),
    save_moe's saved expert rows must still be read with the forward's routing: here the rerun is forced to swap
    one token's first expert, and every other expert's weight gradient stays what the forward's routing gives."""
    calls = [0]

    def flip_on_rerun(ids):  # the forward's selection runs first, the backward's rerun second
        calls[0] += 1
        ids = np.array(ids)
        if calls[0] % 2 == 0:
            ids[0, 0] = next(e for e in reversed(range(TINY["n_routed_experts"])) if e not in ids[0])
        return ids

    select = router.select_experts
    monkeypatch.setattr(router, "select_experts", lambda *a, **k: jax.pure_callback(
        flip_on_rerun, jax.ShapeDtypeStruct(select(*a, **k).shape, jnp.int32), select(*a, **k)))
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, TINY["vocab_size"])
    model = tiny_model(n_layers=2)  # one dense block, one MoE block
    graphdef, state = nnx.split(model)

    def w_gate_grad(ex):
        def loss(state):
            logits, aux = nnx.merge(graphdef, state)(tokens, execution=ex)
            return logits.mean() + aux["balance_loss"]
        calls[0] = 1  # no rerun without remat: every call is a forward's
        return np.asarray(jax.jit(jax.grad(loss))(state)["blocks"][1]["ffn"]["w_gate"][...])

    plain = w_gate_grad(Execution())
    saved = w_gate_grad(Execution(remat=True, remat_policy="save_moe"))
    first = np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(tokens, return_routing=True)[1]["routing"][0][
        "expert_ids"])(state))[0, 0]  # token 0's forward experts: their gates are renormalized by the rerun
    others = [e for e in range(TINY["n_routed_experts"]) if e not in first]
    np.testing.assert_allclose(saved[others], plain[others], rtol=1e-6, atol=1e-8)
