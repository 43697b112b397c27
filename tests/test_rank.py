"""analysis.rank.metrics against formulas on matrices of known rank; analysis.rank on a freshly built model."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from analysis.rank import metrics as rm
from analysis.rank.attention import analyse, documents, forward_paths
from analysis.rank.cli import main
from moe import ModelConfig
from moe.model import Transformer
from tests.conftest import tiny_config


def _low_rank(n, r, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, r)) @ rng.normal(size=(r, n))


@pytest.mark.parametrize("n,r", [(16, 1), (16, 5), (32, 32)])
def test_numerical_rank_known(n, r):
    assert rm.numerical_rank(_low_rank(n, r).astype(np.float32)) == r
    assert rm.numerical_rank(_low_rank(n, r), dtype=np.float64) == r


def test_tolerances():
    A = np.diag([1.0, 1e-3, 1e-8])
    # default tolerance: 1 * 3 * eps_float32 ~ 3.6e-7, so 1e-8 is below it
    assert rm.numerical_rank(A) == 2
    assert rm.numerical_rank(A, rtol=1e-9) == 3
    assert rm.numerical_rank(A, rtol=1e-2) == 1
    stack = np.stack([np.eye(4), np.diag([1.0, 1.0, 0.0, 0.0])])
    np.testing.assert_array_equal(rm.numerical_rank(stack), [4, 2])


def test_effective_rank_formula():
    assert rm.effective_rank(np.eye(7)) == pytest.approx(7.0)
    assert rm.effective_rank(_low_rank(10, 1)) == pytest.approx(1.0, abs=1e-6)
    s = np.array([3.0, 1.0])
    p = s / s.sum()
    assert rm.effective_rank(np.diag(s)) == pytest.approx(np.exp(-(p * np.log(p)).sum()))
    assert rm.effective_rank(s=np.array([2.0, 0.0])) == pytest.approx(1.0)


def test_triangular_logdet_matches_slogdet():
    rng = np.random.default_rng(1)
    L = np.tril(rng.uniform(0.1, 1.0, (6, 6)))
    assert rm.triangular_logdet(L) == pytest.approx(np.linalg.slogdet(L)[1])
    assert rm.triangular_logdet(L.T) == pytest.approx(np.linalg.slogdet(L)[1])
    assert np.isnan(rm.triangular_logdet(L + L.T))
    L[2, 2] = 0
    assert rm.triangular_logdet(L) == -np.inf
    # block lower-triangular with an upper-triangular top-left block (a mixed-mask head)
    A = np.tril(rng.uniform(0.1, 1.0, (6, 6)))
    A[:3, :3] = np.triu(rng.uniform(0.1, 1.0, (3, 3)))
    assert rm.block_triangular_logdet(A, 3) == pytest.approx(np.linalg.slogdet(A)[1])
    assert np.isnan(rm.triangular_logdet(A))
    A[:3, :3] = rng.uniform(0.1, 1.0, (3, 3))  # a bidirectional prefix block: not triangular
    assert np.isnan(rm.block_triangular_logdet(A, 3))


def test_residual_ratio():
    rng = np.random.default_rng(2)
    x = rng.normal(size=8)
    assert rm.residual_ratio(np.tile(x, (5, 1))) == pytest.approx(0.0, abs=1e-12)
    X = rng.normal(size=(5, 8))
    R = X - X.mean(0)
    comp = lambda M: np.sqrt(np.abs(M).sum(0).max() * np.abs(M).sum(1).max())  # noqa: E731
    assert rm.residual_ratio(X) == pytest.approx(comp(R) / comp(X))
    assert rm.residual_ratio(X, "fro") == pytest.approx(np.linalg.norm(R) / np.linalg.norm(X))
    with pytest.raises(ValueError):
        rm.residual_ratio(X, "nuclear")


# --- on the model -----------------------------------------------------------------------------------------------

def _model(mask, **model):
    c = tiny_config(**{"model.mask": mask, **{f"model.{k}": v for k, v in model.items()}})
    return Transformer(ModelConfig(**c.model.to_dict()), nnx.Rngs(0))  # the model alone: no task to match


def _batch(L=24, n=(24, 17), prefix=(10, 6), seed=0):
    rng = np.random.default_rng(seed)
    B = len(n)
    idx = np.arange(L)[None]
    real = idx < np.array(n)[:, None]
    return {"tokens": np.where(real, rng.integers(3, 500, (B, L)), 0).astype(np.int32),
            "segment_ids": real.astype(np.int32), "positions": np.where(real, idx, 0).astype(np.int32),
            "prefix_len": np.array(prefix, np.int32)}


@pytest.fixture(scope="module")
def causal_model():
    return _model("causal")


def test_rewired_full_path_matches_model(causal_model):
    b = _batch()
    probs, hidden = forward_paths(causal_model, b)
    logits, aux = causal_model(jnp.asarray(b["tokens"]), positions_BxL=jnp.asarray(b["positions"]),
                               segment_ids_BxL=jnp.asarray(b["segment_ids"]), return_attention=True)
    x = causal_model.final_norm(jnp.asarray(hidden["full"][-1]))
    np.testing.assert_allclose(x @ causal_model.lm_head[...], logits, atol=1e-4, rtol=1e-4)
    for p, q in zip(probs, aux["attention"]):
        np.testing.assert_allclose(p, q, atol=1e-6)
    assert len(hidden["pure_attn"]) == causal_model.cfg.n_layers + 1


def test_causal_attention_from_model_is_full_rank(causal_model):
    r = analyse(causal_model, _batch())
    full = r["attention"]["full"]
    assert np.all(np.asarray(full["rank_frac"]) == 1.0)
    assert np.all(np.asarray(full["full_rank_share"]) == 1.0)
    assert np.all(np.isfinite(full["logdet_per_token"]))
    assert r["attention"]["full"]["mean_n"] == pytest.approx((24 + 17) / 2)  # padding rows left out
    for c in r["collapse"].values():
        assert len(c["l1linf"]) == causal_model.cfg.n_layers + 1


def test_mixed_heads_see_what_they_should():
    model = _model("mixed")
    b = _batch()
    probs, _ = forward_paths(model, b)
    H = model.cfg.n_heads
    for A_BxHxLxL in probs:
        for row, (n, P) in enumerate(zip((24, 17), b["prefix_len"])):
            A = A_BxHxLxL[row, :, :n, :n]
            q, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
            lower, upper = k <= q, (k >= q) & (k < P)
            for h in range(H):
                allowed = np.where(q < P, upper if h >= H // 2 else lower, lower)
                assert np.all(A[h][~allowed] == 0), (h, n, P)
                assert np.all(A[h][allowed] > 0)
    r = analyse(model, b)
    # every head's matrix stays triangular inside the prefix and block-triangular overall: full rank
    assert np.all(np.isfinite(r["attention"]["full"]["logdet_per_token"]))
    assert np.all(np.isfinite(r["attention"]["prefix"]["logdet_per_token"]))
    assert np.all(np.asarray(r["attention"]["full"]["rank_frac"]) == 1.0)


def test_prefix_block_is_dense_and_not_triangular():
    r = analyse(_model("prefix"), _batch())
    assert np.all(np.isnan(r["attention"]["prefix"]["logdet_per_token"]))
    assert np.all(np.isnan(r["attention"]["full"]["logdet_per_token"]))


def test_packed_row_is_analysed_per_document(causal_model):
    """A validation row packing two documents gives the same statistics as the two documents in rows of their
    own: each document's attention is its own block (segment mask, positions restarting at 0)."""
    rng = np.random.default_rng(1)
    L, n1, n2 = 24, 14, 10
    a, b = rng.integers(3, 500, n1), rng.integers(3, 500, n2)
    packed = {"tokens": np.concatenate([a, b])[None].astype(np.int32),
              "segment_ids": np.repeat([[1, 2]], [n1, n2], axis=1).astype(np.int32),
              "positions": np.concatenate([np.arange(n1), np.arange(n2)])[None].astype(np.int32)}
    alone = {"tokens": np.zeros((2, L), np.int32), "segment_ids": np.zeros((2, L), np.int32),
             "positions": np.zeros((2, L), np.int32)}
    for row, doc in enumerate((a, b)):
        alone["tokens"][row, :len(doc)] = doc
        alone["segment_ids"][row, :len(doc)] = 1
        alone["positions"][row, :len(doc)] = np.arange(len(doc))
    assert documents(packed["segment_ids"]) == [(0, 0, n1, 0), (0, n1, n2, 0)]
    p, s = analyse(causal_model, packed), analyse(causal_model, alone)
    assert p["documents"] == s["documents"] == 2 and p["sequences"] == 1
    for key in ("rank_frac", "erank_frac", "logdet_per_token", "mean_n"):
        np.testing.assert_allclose(p["attention"]["full"][key], s["attention"]["full"][key], rtol=1e-4, atol=1e-5)
    for path in p["collapse"]:
        np.testing.assert_allclose(p["collapse"][path]["l1linf"], s["collapse"][path]["l1linf"], rtol=1e-4)
    np.testing.assert_allclose(p["spectrum"], s["spectrum"], rtol=1e-4, atol=1e-5)


def test_cli_on_trained_run(tmp_path, tiny_run):
    main(["--workdir", str(tiny_run), "--out", str(tmp_path), "--sequences", "3"])
    r = json.loads((tmp_path / "rank.json").read_text())
    assert r["sequences"] == 3 and r["mask"] == "causal"
    assert np.all(np.asarray(r["attention"]["full"]["rank_frac"]) == 1.0)
    for name in ("rank_heads.png", "rank_spectrum.png", "rank_collapse.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--workdir", str(tmp_path / "nothing")])
    assert e.value.code == 2
    assert "does not exist" in capsys.readouterr().err
