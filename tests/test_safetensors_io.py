"""Our own safetensors format: exact round trip of params AND routing biases, for any config."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import moe
from moe.hf.safetensors_io import flat_variables, load_safetensors, read_extra_meta, save_safetensors

BASE = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
            n_routed_experts=4, moe_d_ff=8, top_k=2, init_std=0.2)


def _model(**changes):
    cfg = moe.ModelConfig(**{**BASE, **changes})
    model = moe.Transformer(cfg, nnx.Rngs(3))
    E = cfg.n_routed_experts
    moe.set_routing_biases(model, [jnp.linspace(-0.3, 0.3, E) * (i + 1) for i in range(cfg.n_moe_layers)])
    return model


@nnx.jit
def _logits(model, tokens, prefix_len):
    return model(tokens, prefix_len_B=prefix_len)[0]


@pytest.mark.parametrize("changes", [
    dict(mask="prefix", rope=False),
    dict(mask="mixed", tie_embeddings=True, first_k_dense=0, n_shared_experts=0),
])
def test_round_trip_identical(tmp_path, changes):
    model = _model(**changes)
    save_safetensors(model, str(tmp_path), extra_meta={"step": 7, "data": "tiny"})
    loaded = load_safetensors(str(tmp_path))
    assert loaded.cfg == model.cfg
    a, b = flat_variables(model), flat_variables(loaded)
    assert a.keys() == b.keys() and any(k.endswith("ffn.bias") for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert isinstance(loaded.blocks[-1].ffn.bias, moe.RoutingBias)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 9)))
    prefix = jnp.array([4, 6])
    np.testing.assert_array_equal(np.asarray(_logits(model, tokens, prefix)),
                                  np.asarray(_logits(loaded, tokens, prefix)))
    assert read_extra_meta(str(tmp_path)) == {"step": 7, "data": "tiny"}


def test_missing_and_mismatched_files(tmp_path):
    with pytest.raises(ValueError, match="moe_config.json: missing"):
        load_safetensors(str(tmp_path / "nowhere"))
    model = _model()
    save_safetensors(model, str(tmp_path))
    weights = str(tmp_path / "model.safetensors")
    tensors = load_file(weights)

    # A tensor gone.
    save_file({k: v for k, v in tensors.items() if k != "blocks.1.ffn.bias"}, weights)
    with pytest.raises(ValueError, match="'blocks.1.ffn.bias' missing"):
        load_safetensors(str(tmp_path))

    # Config and weights disagree on a shape.
    save_file(tensors, weights)
    cfg_path = tmp_path / "moe_config.json"
    fields = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**fields, "d_ff": 48}))
    with pytest.raises(ValueError, match=r"'blocks.0.ffn.w_down' is float32\[32, 16\].*needs float32\[48, 16\]"):
        load_safetensors(str(tmp_path))

    # Unknown config field; then no weights file at all.
    cfg_path.write_text(json.dumps({**fields, "mystery": 1}))
    with pytest.raises(ValueError, match="unknown ModelConfig field.*mystery"):
        load_safetensors(str(tmp_path))
    cfg_path.write_text(json.dumps(fields))
    os.remove(weights)
    with pytest.raises(ValueError, match="model.safetensors: missing"):
        load_safetensors(str(tmp_path))
