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
    (dict(router_score="relu"), "model.router_score"),
    (dict(qk_norm="layer"), "model.qk_norm"),
    (dict(rope_fraction=0.0), "model.rope_fraction"),
    (dict(rope_fraction=0.3, head_dim=64), "model.rope_fraction"),  # int(19.2) = 19 rotated dims: odd
    (dict(shared_expert_gate=True, n_shared_experts=0), "model.shared_expert_gate"),
    (dict(dense_layers="1,x"), "model.dense_layers"),
    (dict(dense_layers="4", n_layers=4), "model.dense_layers"),
    (dict(dense_layers=[1]), "model.dense_layers"),
    (dict(moe_layer_step=0), "model.moe_layer_step"),
    (dict(shared_d_ff=-1), "model.shared_d_ff"),
    (dict(qkv_bias=1), "model.qkv_bias"),
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


def test_moe_layer_placement():
    """first_k_dense, then every moe_layer_step-th layer, minus dense_layers (Qwen's decoder_sparse_step and
    mlp_only_layers)."""
    cfg = ModelConfig(n_layers=6, first_k_dense=1, moe_layer_step=2, dense_layers="3")
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == [1, 5] and cfg.n_moe_layers == 2
    assert ModelConfig(n_layers=4, first_k_dense=0, dense_layers=" 0, 2 ").dense_layer_ids == (0, 2)


def test_checkpoint_written_before_new_fields_still_resumes():
    """A checkpoint's model dict from before a field existed lacks the key: it counts as the field's default (every
    field added since is off by default), so the run resumes; a non-default value on either side is refused."""
    import dataclasses

    from rundir.checkpoints import check_compatible
    from train.errors import UserError

    new_fields = ("moe_layer_step", "dense_layers", "rope_fraction", "qkv_bias", "attn_out_bias", "qk_norm",
                  "router_score", "shared_d_ff", "shared_expert_gate")
    old = {k: v for k, v in dataclasses.asdict(ModelConfig()).items() if k not in new_fields}
    check_compatible(old, ModelConfig(), "old run")
    with pytest.raises(UserError, match="model.router_score"):
        check_compatible(old, ModelConfig(router_score="softmax"), "old run")
    with pytest.raises(UserError, match="model.qk_norm"):
        check_compatible({**old, "qk_norm": "head"}, ModelConfig(), "old run")
