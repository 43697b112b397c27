"""HF import parity for ernie4_5_moe, dots1, hunyuan_v1_moe, minimax_m2 and hy_v3: a tiny random transformers model of
each, saved with save_pretrained, loads into our model with the same logits (fp32), the same expert ids in every
MoE layer and the same KV-cached greedy tokens as transformers' `generate`; `analysis.routing --hf` runs on it;
what transformers would compute differently from the checkpoint's authors, or what we do not reproduce, is refused
naming the field."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
from tests.hf_random import (  # noqa: E402
    EX,
    hf_forward,
    hf_generate,
    ours_forward,
    random_hf,
    routing_on_hf,
    same_experts,
)

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()  # Hunyuan's rope `alpha` is reported as an unknown key

from moe import param_counts  # noqa: E402
from moe.decoding.generate import generate  # noqa: E402
from moe.hf import HFImportError, load_hf_moe, model_config  # noqa: E402
from moe.hf.tensors import read_tensors  # noqa: E402

V, N_NEW = 320, 12  # V >= the test tokenizer's vocabulary
TOKENS = np.random.RandomState(0).randint(2, V, (2, 12))
STACK = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             max_position_embeddings=256, hidden_act="silu", eos_token_id=None, bos_token_id=None)

# Each family with its distinguishing options on: ERNIE's interleaved RoPE, selection bias and MoE range with an
# interval (layers 1, 3 MoE; 0, 2, 4 dense), dots1's groups, q/k norm and o bias, Hunyuan's NTK alpha, q/k norm
# after RoPE and per-layer K, MiniMax's whole-projection q/k norms and partial RoPE, Hy3's dense layers by
# mlp_layer_types, the block's bias and router_scaling_factor.
FAMILIES = {
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(
        **STACK, num_hidden_layers=5, head_dim=12, intermediate_size=48, moe_intermediate_size=16, moe_num_experts=8,
        moe_k=2, moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=3, moe_layer_interval=2,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "dots1": lambda: transformers.Dots1Config(
        **STACK, num_hidden_layers=3, head_dim=12, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(
        **STACK, head_dim=8, num_hidden_layers=3, intermediate_size=16, num_experts=8, moe_topk=[2, 3, 1],
        attention_bias=True, rope_parameters={"rope_type": "dynamic", "rope_theta": 500.0, "alpha": 10.0,
                                              "factor": 1.0}),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        **STACK, intermediate_size=24, num_hidden_layers=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}),
    "hy_v3": lambda: transformers.HYV3Config(
        **STACK, head_dim=8, num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=2, router_scaling_factor=2.826,
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> dict(path, HF logits and expert ids, HF's greedy tokens, the HF model); each built once."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = random_hf(FAMILIES[name]())
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(str(path))
            cache[name] = dict(name=name, path=str(path), hf=hf, forward=hf_forward(hf, TOKENS),
                               tokens=hf_generate(hf, TOKENS[:, :5], N_NEW))
        return cache[name]

    return get


@pytest.fixture(params=list(FAMILIES))
def family(request, built):
    return built(request.param)


def test_logits_experts_and_greedy_tokens_match_transformers(family):
    model, _ = load_hf_moe(family["path"])
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    hf_logits, hf_ids = family["forward"]
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    agree = same_experts(ids, hf_ids)
    print(f"{family['name']}: max |logit diff| / max |logit| = {err:.1e}; experts {agree}")
    assert err <= 1e-4, err
    assert len(hf_ids) == model.cfg.n_moe_layers > 0 and agree == [1.0] * model.cfg.n_moe_layers
    ours = generate(model, jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours), family["tokens"])
    # ERNIE's selection bias is a torch Parameter; ours, a RoutingBias as in every family, is not trained
    n_hf = sum(p.numel() for k, p in family["hf"].named_parameters() if not k.endswith("e_score_correction_bias"))
    assert param_counts(model.cfg)["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert param_counts(model.cfg)["total"] == n_hf


def test_each_family_maps_its_distinguishing_options(built):
    """The options the parity test exercises are the ones read from config.json."""
    cfg = lambda name: model_config(json.loads((Path(built(name)["path"]) / "config.json").read_text()))
    ernie = cfg("ernie4_5_moe")
    assert ernie.rope_interleave and ernie.moe_layer_ids == (1, 3) and ernie.router == "softmax"
    dots = cfg("dots1")
    assert (dots.n_group, dots.topk_group, dots.routed_scaling_factor, dots.qk_norm, dots.attn_out_bias) == \
        (4, 2, 2.5, "head", True)
    hunyuan = cfg("hunyuan_v1_moe")
    assert hunyuan.qk_norm_after_rope and hunyuan.layer_top_k == "2,3,1"
    assert hunyuan.rope_theta == pytest.approx(500.0 * 10.0 ** (8 / 6))
    minimax = cfg("minimax_m2")
    assert (minimax.qk_norm, minimax.rope_dim, minimax.router) == ("full", 8, "sigmoid")
    hy = cfg("hy_v3")
    assert (hy.moe_layer_ids, hy.routed_scaling_factor, hy.shared_width) == ((1, 3), 2.826, 32)


def test_hy3_mtp_layers_are_skipped(built, tmp_path):
    """Hy3 stores its MTP layer after the last layer (transformers ignores it): with num_nextn_predict_layers it is
    skipped, without it refused as a layer the config does not have."""
    path = Path(built("hy_v3")["path"])
    shutil.copytree(path, tmp_path / "hy", dirs_exist_ok=True)
    sd = read_tensors(str(path))
    extra = {"model.layers.4.eh_proj.weight": np.zeros((32, 64), np.float32),
             "model.layers.4.input_layernorm.weight": np.ones(32, np.float32)}
    save_file({**sd, **extra}, str(tmp_path / "hy" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFImportError, match="unexpected tensor.*model.layers.4"):
        load_hf_moe(str(tmp_path / "hy"))
    c = json.loads((path / "config.json").read_text())
    (tmp_path / "hy" / "config.json").write_text(json.dumps(dict(c, num_nextn_predict_layers=1)))
    assert load_hf_moe(str(tmp_path / "hy"))[0].cfg.n_layers == 4


def test_routing_analysis_runs_on_each_family(family, tmp_path):
    a, doc = routing_on_hf(family["path"], tmp_path)
    cfg = model_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert doc["model_type"] == family["name"] and doc["layer_ids"] == list(cfg.moe_layer_ids)
    assert a.n_tokens > 0 and doc["n_experts"] == cfg.n_routed_experts


def _config(name, **changes):
    c = FAMILIES[name]().to_dict()
    c.update(changes)
    return {k: v for k, v in c.items() if v != "DELETE"}


@pytest.mark.parametrize("name,changes,field", [
    ("ernie4_5_moe", dict(use_bias=True), "use_bias"),
    ("ernie4_5_moe", dict(moe_norm_min=1e-6), "moe_norm_min"),
    ("ernie4_5_moe", dict(moe_layer_start_index=5), "moe_layer_start_index"),
    ("ernie4_5_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}), "rope_type"),
    ("ernie4_5_moe", dict(moe_k="2"), "field 'moe_k' is a string"),
    ("dots1", dict(layer_types=None, sliding_window=8, max_window_layers=1), "layer_types"),
    ("dots1", dict(layer_types=["full_attention", "sliding_attention", "full_attention"]), "layer_types"),
    ("dots1", dict(scoring_func="softmax"), "scoring_func"),
    ("dots1", dict(n_shared_experts=None), "n_shared_experts"),
    ("hunyuan_v1_moe", dict(head_dim=None), "head_dim"),
    ("hunyuan_v1_moe", dict(use_cla=True), "use_cla"),
    ("hunyuan_v1_moe", dict(use_qk_norm=False), "use_qk_norm"),
    ("hunyuan_v1_moe", dict(num_shared_expert=[1, 2, 1]), "num_shared_expert"),
    ("hunyuan_v1_moe", dict(moe_intermediate_size=[16, 16, 8]), "moe_intermediate_size"),
    ("hunyuan_v1_moe", dict(moe_topk=[2, 3]), "moe_topk"),
    ("hunyuan_v1_moe", dict(moe_topk=["2"]), "field 'moe_topk' is a list"),
    ("hunyuan_v1_moe", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 500.0, "factor": 2.0}),
     "rope_type"),
    ("minimax_m2", dict(use_qk_norm=False), "use_qk_norm"),
    ("minimax_m2", dict(scoring_func="softmax"), "scoring_func"),
    ("hy_v3", dict(route_norm=False), "route_norm"),
    ("hy_v3", dict(moe_router_enable_expert_bias=False), "moe_router_enable_expert_bias"),
    ("hy_v3", dict(qk_norm="true"), "field 'qk_norm' is a string"),
    ("hy_v3", dict(num_shared_experts=0), "num_shared_experts"),
    ("hy_v3", dict(mlp_bias=True), "mlp_bias"),
    ("hy_v3", dict(first_k_dense_replace=1), "first_k_dense_replace"),
    ("hy_v3", dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),
])
def test_refused_configs_name_the_field(name, changes, field):
    with pytest.raises(HFImportError, match=field) as e:
        model_config(_config(name, **changes))
    assert "\n" not in str(e.value)


def test_hunyuan_original_lists_that_agree_with_transformers_are_accepted():
    """Hunyuan-A13B's config.json keeps per-layer lists transformers ignores; equal to what it builds, they load."""
    base = model_config(_config("hunyuan_v1_moe"))
    assert model_config(_config("hunyuan_v1_moe", moe_intermediate_size=[16] * 3, num_shared_expert=[1] * 3,
                                use_qk_norm=True, use_mixed_mlp_moe=True, use_cla=False)) == base
    assert model_config(_config("hunyuan_v1_moe", moe_topk=[2, 2, 2])).layer_top_k == ""


def test_minimax_rotary_dim_is_partial_rotary():
    """Released MiniMax-M2 configs give rotary_dim (transformers: partial_rotary_factor = rotary_dim / head_dim)."""
    c = _config("minimax_m2", rope_parameters=None, rope_theta=5e6, rotary_dim=8)
    assert model_config(c) == model_config(_config("minimax_m2"))
