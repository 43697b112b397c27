"""Every config validation error names the field and what is allowed."""

import dataclasses
import importlib
import time
from pathlib import Path

import pytest

from configs.base import base_config
from configs.default import get_config
from moe import ConfigError, Execution, ModelConfig, sharding
from moe.dispatch.execution import DISPATCH_MODES, check_model, check_tokens, execution_fields
from plumbing.errors import UserError
from rundir.checkpoints import check_compatible
from rundir.config_layout import migrate, pre_split_layout
from tests.conftest import tiny_config
from train.command_line import unknown_key_error
from train.preflight import activation_bytes, causality_warning, parse


@pytest.mark.parametrize("changes,field", [
    (dict(top_k=9, n_routed_experts=8), "model.top_k"),
    (dict(n_routed_experts=10, n_group=4), "model.n_group"),
    (dict(n_group=2, topk_group=3), "model.topk_group"),
    (dict(n_heads=6, n_kv_heads=4), "model.n_kv_heads"),
    (dict(mask="sideways"), "model.mask"),
    (dict(d_model=0), "model.d_model"),
    (dict(n_layers=-1), "model.n_layers"),
    (dict(moe_d_ff=0), "model.moe_d_ff"),
    (dict(first_k_dense=5, n_layers=4), "model.first_k_dense"),
    (dict(router="relu"), "model.router"),
    (dict(router_group_score="sum"), "model.router_group_score"),
    (dict(n_routed_experts=8, n_group=8, top_k=2, topk_group=2), "model.n_group"),  # top2_sum: >= 2 per group
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


@pytest.mark.parametrize("changes,field", [
    (dict(dispatch="magic"), "execution.dispatch"),
    (dict(capacity_factor=0.0), "execution.capacity_factor"),
    (dict(capacity_factor="big"), "execution.capacity_factor"),
    (dict(capacity_factor=float("inf")), "execution.capacity_factor"),
    (dict(grouped_matmul="cutlass"), "execution.grouped_matmul"),
    (dict(attention_impl="flash"), "execution.attention_impl"),
    (dict(attention_impl="cudnn", dtype="float32"), "execution.attention_impl"),
    (dict(dtype="int8"), "execution.dtype"),
    (dict(remat=1), "execution.remat"),
    (dict(remat_policy="save_all"), "execution.remat_policy"),
    (dict(permute_grad="atomic"), "execution.permute_grad"),
    (dict(scan_layers=1), "execution.scan_layers"),
])
def test_execution_validation_errors(changes, field):
    with pytest.raises(ConfigError, match=field):
        Execution(**changes)


def test_execution_checks_against_the_model():
    with pytest.raises(ConfigError, match="execution.attention_impl.*head_dim"):
        check_model(Execution(attention_impl="cudnn", dtype="bfloat16"), ModelConfig(head_dim=12))
    mesh = sharding.make_mesh(1, 1, 8, 1)
    with pytest.raises(ConfigError, match="n_routed_experts"):
        check_model(Execution(dispatch="expert_parallel", mesh=mesh), ModelConfig(n_routed_experts=12))
    with pytest.raises(ConfigError, match="data\\*fsdp\\*expert = 8"):
        check_tokens(Execution(dispatch="expert_parallel_dropless", mesh=mesh), 12)
    check_tokens(Execution(dispatch="dropless", mesh=mesh), 12)  # the auto-sharded path takes any count


def test_valid_default():
    cfg = ModelConfig()
    assert cfg.n_moe_layers == cfg.n_layers - cfg.first_k_dense


@pytest.mark.parametrize("dispatch", DISPATCH_MODES)
def test_dispatch_modes_valid(dispatch):
    assert Execution(dispatch=dispatch, capacity_factor=2).dispatch == dispatch


def test_base_config_mirrors_model_config_and_execution():
    """configs/base.py lists every ModelConfig and Execution field with the same default, so each one is a
    command-line flag; no model key says how to run."""
    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    assert base_config().model.to_dict() == fields
    assert base_config().execution.to_dict() == execution_fields()
    assert not set(fields) & set(execution_fields())


def test_old_run_config_migrates_and_moved_flags_say_where():
    old = {"model": {"d_model": 64, "dispatch": "capacity", "dtype": "bfloat16", "balance_loss_weight": 0.0},
           "train": {"steps": 5}}
    new = migrate(old)
    assert new["model"] == {"d_model": 64}
    assert new["execution"] == {"dispatch": "capacity", "dtype": "bfloat16"}
    assert new["train"] == {"steps": 5, "balance_loss_weight": 0.0}
    assert old["model"]["dispatch"] == "capacity"  # the input is left as it was
    assert pre_split_layout({**new, "eval": {"every": 1, "dispatch": ""}}) == {**old, "eval": {"every": 1}}
    # Experiment caches written before the split keep their fingerprint: today's base config in the old layout.
    legacy = pre_split_layout(base_config().to_dict())
    assert "execution" not in legacy and legacy["model"]["dispatch"] == "dropless"
    assert legacy["model"]["balance_loss_weight"] == 1e-4 and "balance_loss_weight" not in legacy["train"]
    assert ModelConfig.from_dict({"d_model": 64, "dispatch": "capacity", "remat": True}).d_model == 64
    msg = str(unknown_key_error("model.dispatch", []))
    assert "execution.dispatch" in msg and "\n" not in msg


def test_moe_layer_placement():
    """first_k_dense, then every moe_layer_step-th layer, minus dense_layers (Qwen's decoder_sparse_step and
    mlp_only_layers)."""
    cfg = ModelConfig(n_layers=6, first_k_dense=1, moe_layer_step=2, dense_layers="3")
    assert cfg.moe_layer_ids == (1, 5) and cfg.n_moe_layers == 2
    assert ModelConfig(n_layers=4, first_k_dense=0, dense_layers=" 0, 2 ").dense_layer_ids == (0, 2)


@pytest.mark.parametrize("field", ["n_layers", "mtp_depth"])
def test_layer_counts_are_bounded_and_checked_in_time_independent_of_them(field):
    with pytest.raises(ConfigError, match=f"model.{field}: must be in \\[.*4096\\], got 1000000000"):
        ModelConfig(**{field: 10**9})
    # the largest accepted model validates and is counted without work quadratic in its depth
    from moe.accounting import param_counts

    start = time.perf_counter()
    big = ModelConfig(n_layers=4096, mtp_depth=4096, first_k_dense=1, n_hash_layers=4000,
                      layer_top_k=",".join(["2"] * 4095))
    assert param_counts(big)["total"] > 0 and big.moe_top_k(4095) == 2 and big.layer_router(3) == "hash"
    assert time.perf_counter() - start < 10


def test_checkpoint_written_before_new_fields_still_resumes():
    """A checkpoint's model dict from before a field existed lacks the key: it counts as the field's default (every
    field added since is off by default), so the run resumes; a non-default value on either side is refused.
    Execution fields that checkpoints once held under "model" (dispatch, dtype, ...) are ignored."""
    new_fields = ("moe_layer_step", "dense_layers", "rope_fraction", "qkv_bias", "attn_out_bias", "qk_norm",
                  "router", "shared_d_ff", "shared_expert_gate")
    old = {k: v for k, v in dataclasses.asdict(ModelConfig()).items() if k not in new_fields}
    check_compatible(old, ModelConfig(), "old run")
    check_compatible({**old, "dispatch": "capacity", "dtype": "bfloat16", "remat": True,
                      "balance_loss_weight": 0.0}, ModelConfig(), "old run")
    with pytest.raises(UserError, match="model.router"):
        check_compatible(old, ModelConfig(router="softmax"), "old run")
    with pytest.raises(UserError, match="model.qk_norm"):
        check_compatible({**old, "qk_norm": "head"}, ModelConfig(), "old run")


def test_causal_run_with_a_dropping_dispatch_is_warned():
    for dispatch, warned in (("dropless", False), ("expert_parallel_dropless", False), ("capacity", True),
                             ("expert_parallel", True)):
        c = tiny_config(**{"execution.dispatch": dispatch})
        msg = causality_warning(parse(c))
        assert (msg is not None) == warned and (not warned or "not strictly causal" in msg)


def test_activation_bound_follows_attention_impl_and_loss_chunks():
    """The memory check's lower bound: the logits shrink by loss_chunks; blockwise under a causal mask keeps 5/8 of
    einsum's [H, L, L] square at 4 query blocks; the fused kernels keep none."""
    def bound(**execution):
        c = get_config()
        c.execution.update(**execution)
        return activation_bytes(parse(c), data_parallel=1)

    c = get_config()
    mcfg, rows, L = parse(c).model, c.train.batch_size, c.data.seq_len
    logits, square = rows * L * mcfg.vocab_size * 8, rows * mcfg.n_heads * L * L * 8 * mcfg.n_layers
    assert bound(attention_impl="einsum", loss_chunks=1) == logits + square
    assert bound(attention_impl="blockwise", loss_chunks=1) == logits + square * 5 // 8
    assert bound(attention_impl="xla") == logits // 8  # the default: 8 chunks


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "configs").glob("*.py")
                                        if p.stem not in ("__init__", "base")))
def test_every_bundled_config_passes_the_trainers_checks(name):
    """Each configs/NAME.py builds a config the trainer accepts (types, ranges, a valid ModelConfig)."""
    c = importlib.import_module(f"configs.{name}").get_config()
    parse(c)
