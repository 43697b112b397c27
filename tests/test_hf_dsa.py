"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`) up to the indexer's top-k: a tiny random transformers
model of each (sparse attention keeping index_topk = 24 keys per query, YaRN for V3.2, groups, a dense first layer)
loads with transformers' logits, expert ids and KV-cached greedy tokens while no query sees more than 24 keys;
longer inputs and KV caches are refused in one line (also by analysis.routing --hf). The indexer's tensors are
skipped (not read): up to index_topk keys they change nothing."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
transformers.utils.logging.set_verbosity_error()

from analysis.routing import cli as routing  # noqa: E402
from moe.decoding.generate import generate  # noqa: E402
from moe.hf import HFImportError, load_hf_moe, model_config  # noqa: E402
from plumbing.errors import UserError  # noqa: E402

V, TOP, N_NEW = 320, 24, 12
TOKENS = np.random.RandomState(0).randint(2, V, (2, 12))
MLA = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
           qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
           first_k_dense_replace=1, index_topk=TOP, index_head_dim=16, index_n_heads=2, rms_norm_eps=1e-5,
           max_position_embeddings=163840, eos_token_id=None, bos_token_id=None, pad_token_id=None)
FAMILIES = {
    "deepseek_v32": lambda: transformers.DeepseekV32Config(
        **MLA, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(
        **MLA, routed_scaling_factor=1.8, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    hf = random_hf(FAMILIES[name]())
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(str(path))
    return dict(name=name, path=str(path), forward=hf_forward(hf, TOKENS), tokens=hf_generate(hf, TOKENS[:, :5], N_NEW))


def test_logits_experts_and_greedy_tokens_match_transformers_up_to_index_topk(family):
    model, _ = load_hf_moe(family["path"])
    assert (model.cfg.attention, model.cfg.max_keys, model.cfg.rope_interleave) == ("mla", TOP, True)
    logits, ids = ours_forward(model, jnp.asarray(TOKENS))
    hf_logits, hf_ids = family["forward"]
    err = np.abs(np.asarray(logits) - hf_logits).max() / np.abs(hf_logits).max()
    print(f"{family['name']}: max |logit diff| / max |logit| = {err:.1e}; experts {same_experts(ids, hf_ids)}")
    assert err <= 1e-4
    assert same_experts(ids, hf_ids) == [1.0] * model.cfg.n_moe_layers == [1.0, 1.0]
    ours = generate(model, jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=N_NEW, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours), family["tokens"])
    # past index_topk keys the sparse attention would drop some: refused, in one line
    with pytest.raises(UserError, match=f"25 tokens per row exceed model.max_keys={TOP}") as e:
        model(jnp.zeros((1, TOP + 1), jnp.int32))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=f"a KV cache of {5 + TOP} slots"):
        generate(model, jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=TOP, temperature=0.0)


def test_routing_analysis_within_and_past_index_topk(family, tmp_path, capsys):
    a, doc = routing_on_hf(family["path"], tmp_path)  # 16-token rows
    assert doc["layer_ids"] == [1, 2] and a.n_tokens > 0
    args = ["--hf", str(tmp_path / "hf"), "--text", str(tmp_path / "prose.txt"), "--batch_size", "4", "--no_progress"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        routing.main([*args, "--out", str(tmp_path / "long"), "--seq_len", "32"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "exceed model.max_keys=24" in err and "\n" not in err, err


@pytest.mark.parametrize("changes,field", [
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(index_topk=0), "index_topk"),
    (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),
])
def test_refused_configs_name_the_field(changes, field):
    c = dict(FAMILIES["deepseek_v32"]().to_dict(), **changes)
    with pytest.raises(HFImportError, match=field):
        model_config(c)
