"""Every config validation error names the field and what is allowed."""

import pytest

from moe import ConfigError, ModelConfig


@pytest.mark.parametrize("changes,field", [
    (dict(top_k=9, n_routed_experts=8), "model.top_k"),
    (dict(n_routed_experts=10, n_group=4), "model.n_group"),
    (dict(n_group=2, topk_group=3), "model.topk_group"),
    (dict(n_heads=6, n_kv_heads=4), "model.n_kv_heads"),
    (dict(mask="sideways"), "model.mask"),
    (dict(d_model=0), "model.d_model"),
    (dict(n_layers=-1), "model.n_layers"),
    (dict(moe_d_ff=0), "model.moe_d_ff"),
    (dict(dispatch="magic"), "model.dispatch"),
    (dict(first_k_dense=5, n_layers=4), "model.first_k_dense"),
    (dict(balance_loss_weight=-1.0), "model.balance_loss_weight"),
    (dict(capacity_factor=0.0), "model.capacity_factor"),
    (dict(capacity_factor="big"), "model.capacity_factor"),
    (dict(grouped_matmul="cutlass"), "model.grouped_matmul"),
    (dict(attention_impl="flash"), "model.attention_impl"),
    (dict(attention_impl="cudnn", dtype="float32"), "model.attention_impl"),
    (dict(attention_impl="cudnn", dtype="bfloat16", head_dim=12), "model.attention_impl"),
])
def test_validation_errors(changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**changes)


def test_valid_default():
    cfg = ModelConfig()
    assert cfg.n_moe_layers == cfg.n_layers - cfg.first_k_dense


@pytest.mark.parametrize("dispatch", ["dropless", "capacity", "expert_parallel", "reference"])
def test_dispatch_modes_valid(dispatch):
    assert ModelConfig(dispatch=dispatch, capacity_factor=2).dispatch == dispatch


def test_base_config_mirrors_model_config():
    """configs/base.py lists every ModelConfig field with the same default, so each one is a command-line flag."""
    import dataclasses

    from configs.base import base_config

    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    assert base_config().model.to_dict() == fields
