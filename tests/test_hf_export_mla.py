"""HF export of multi-head latent attention models as DeepseekV3ForCausalLM (moe/hf/write_mla.py): transformers
loads the export with no missing or unexpected weights and gives our logits (fp32) and our greedy tokens (KV-cached
decode against generate); importing the export back (moe.hf.load_hf_moe) gives the same parameters bit for bit and
the same config; what deepseek_v3 cannot reproduce is refused in one line naming the field."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe
from moe.config import ConfigError
from moe.decoding.generate import generate
from moe.hf import load_hf_moe
from moe.hf.safetensors_io import flat_variables
from moe.hf.write import ExportError, architecture, hf_config, unsupported_features, write_hf_checkpoint
from tests import test_hf_export
from tests.test_hf_export import CARD, EX, V, _forward, _hf, _hf_logits

tokenizer_path = test_hf_export.tokenizer_path  # the fixture: a BPE tokenizer.json, <|endoftext|> 0, <|pad|> 1

# A dense first layer, 8 experts top-2 in 4 groups with 2 kept, random non-zero routing biases, a query latent,
# interleaved RoPE with YaRN past its 8 original positions (max_position_embeddings = 8 x factor: no HF warning).
MLA = dict(vocab_size=V, d_model=32, n_layers=3, n_heads=4, d_ff=64, first_k_dense=1, n_routed_experts=8,
           n_shared_experts=1, top_k=2, moe_d_ff=16, n_group=4, topk_group=2, routed_scaling_factor=2.5,
           rope_theta=500.0, norm_eps=1e-6, init_std=0.3, attention="mla", q_lora_rank=24, kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6, rope_interleave=True, rope_scaling_factor=4.0,
           rope_original_max_position=8, yarn_mscale=1.0, yarn_mscale_all_dim=0.7)
# No query latent (one q_proj: q_lora_rank null), rotate-half plain RoPE, tied embeddings, 2 shared experts.
PLAIN = dict(MLA, q_lora_rank=0, rope_interleave=False, rope_scaling_factor=1.0, rope_original_max_position=0,
             yarn_mscale=0.0, yarn_mscale_all_dim=0.0, tie_embeddings=True, n_shared_experts=2)
CASES = {"yarn_q_lora": MLA, "plain_no_q_lora": PLAIN}
TOKENS = np.random.RandomState(0).randint(2, V, (2, 20))  # past YaRN's 8 original positions
N_NEW = 16


def _model(changes):
    cfg = moe.ModelConfig(**changes)
    model = moe.Transformer(cfg, nnx.Rngs(0))
    rng = np.random.RandomState(1)
    # Biases of the size of the score spread (sigmoid in (0, 1)), so they change which experts are chosen.
    moe.set_routing_biases(model, [jnp.asarray(rng.uniform(-0.5, 0.5, cfg.n_routed_experts), jnp.float32)
                                   for _ in range(cfg.n_moe_layers)])
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer_path):
    """name -> dict(model, path, hf model, our logits, HF logits), each case built and exported once (fp32)."""
    _, transformers = _hf()
    transformers.utils.logging.disable_progress_bar()  # from_pretrained's bar on stderr
    cache = {}

    def get(name):
        if name not in cache:
            model = _model(CASES[name])
            path = str(tmp_path_factory.mktemp(name))
            write_hf_checkpoint(model, path, tokenizer_path, "float32", CARD, max_position_embeddings=32)
            hf, theirs = _hf_logits(path, TOKENS)  # asserts no missing / unexpected / mismatched keys
            ours = np.asarray(_forward(model, jnp.asarray(TOKENS))[0], np.float32)
            cache[name] = dict(model=model, path=path, hf=hf, ours=ours, theirs=theirs)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(exported, name):
    f = exported(name)
    err, scale = np.abs(f["ours"] - f["theirs"]).max(), np.abs(f["ours"]).max()
    print(f"{name}: max |ours - HF| = {err:.2e} ({err / scale:.2e} of max |logit| {scale:.2f}); argmax agreement "
          f"{np.mean(f['ours'].argmax(-1) == f['theirs'].argmax(-1)):.3f}")
    assert err <= 1e-4 * scale, (name, err, scale)
    cfg, hc = f["model"].cfg, f["hf"].config
    assert type(f["hf"]).__name__ == architecture(cfg) == "DeepseekV3ForCausalLM"
    assert (hc.q_lora_rank, hc.rope_interleave, hc.num_mtp_layers, hc.first_k_dense_replace) == (
        cfg.q_lora_rank or None, cfg.rope_interleave, 0, 1)
    assert hc.tie_word_embeddings is cfg.tie_embeddings
    assert hc.rope_parameters["rope_type"] == ("yarn" if cfg.rope_scaling_factor > 1 else "default")
    biases = moe.routing_biases(f["model"])
    np.testing.assert_array_equal(f["hf"].model.layers[1].mlp.gate.e_score_correction_bias.numpy(), biases[0])


def test_routing_biases_matter(exported):
    """Without the biases other experts win somewhere: the parity above covers the selection bias."""
    model = exported("yarn_q_lora")["model"]
    _, ids_biased = _forward(model, jnp.asarray(TOKENS))
    saved = moe.routing_biases(model)
    moe.set_routing_biases(model, [jnp.zeros_like(b) for b in saved])
    _, ids_plain = _forward(model, jnp.asarray(TOKENS))
    moe.set_routing_biases(model, saved)
    assert any(not np.array_equal(a, b) for a, b in zip(ids_biased, ids_plain))


def test_greedy_generation_matches(exported):
    """16 new tokens from 5-token prompts, 2 rows, past YaRN's 8 original positions: our prefill + one-token steps
    over the latent cache (absorbed form) against transformers' generate with its own cache, EOS stop off."""
    torch, _ = _hf()
    f = exported("yarn_q_lora")
    prompt = TOKENS[:, :5]
    ours = np.asarray(generate(f["model"], jnp.asarray(prompt), jax.random.key(0), execution=EX, max_new_tokens=N_NEW,
                               temperature=0.0))
    f["hf"].generation_config.eos_token_id = None  # generate exactly N_NEW tokens, as ours does
    with torch.no_grad():
        out = f["hf"].generate(torch.tensor(prompt), attention_mask=torch.ones_like(torch.tensor(prompt)),
                               do_sample=False, max_new_tokens=N_NEW)
    np.testing.assert_array_equal(ours, out[:, prompt.shape[1]:].numpy())


@pytest.mark.parametrize("name", list(CASES))
def test_import_back_is_bit_identical(exported, name):
    f = exported(name)
    back, tokenizer = load_hf_moe(f["path"])
    assert tokenizer is not None
    cfg = f["model"].cfg
    # The importer sets what deepseek_v3 fixes (latent eps 1e-6, head_dim = the rotary dims); the rest round-trips.
    assert back.cfg == cfg.replace(latent_norm_eps=1e-6, head_dim=cfg.qk_rope_head_dim), (back.cfg, cfg)
    ours, theirs = flat_variables(f["model"]), flat_variables(back)
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and np.array_equal(ours[k], theirs[k]), k


def test_bfloat16_export_keeps_the_router_fp32(tmp_path, tokenizer_path):
    torch, transformers = _hf()
    model = _model(dict(MLA, n_layers=2))
    write_hf_checkpoint(model, str(tmp_path), tokenizer_path, "bfloat16", CARD, max_position_embeddings=32)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    gate = hf.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    np.testing.assert_array_equal(gate.weight.detach().numpy(), np.asarray(model.blocks[1].ffn.router[...]).T)


def test_config_json_fields():
    c = hf_config(moe.ModelConfig(**MLA), eos_token_id=0, pad_token_id=1, max_position_embeddings=32)
    assert (c["model_type"], c["architectures"]) == ("deepseek_v3", ["DeepseekV3ForCausalLM"])
    assert (c["scoring_func"], c["topk_method"], c["num_nextn_predict_layers"], c["attention_bias"]) == (
        "sigmoid", "noaux_tc", 0, False)
    assert (c["n_group"], c["topk_group"], c["first_k_dense_replace"], c["num_key_value_heads"]) == (4, 2, 1, 4)
    assert c["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 500.0, "partial_rotary_factor": 1.0,
                                    "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}
    assert c["rope_scaling"] == {**c["rope_parameters"], "type": "yarn"}
    plain = hf_config(moe.ModelConfig(**PLAIN), eos_token_id=0, pad_token_id=1)
    assert plain["q_lora_rank"] is None and plain["rope_scaling"] is None
    assert plain["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}
    # An unset mscale (0) is left out: transformers reads a missing key as 0.
    rp = hf_config(moe.ModelConfig(**dict(MLA, yarn_mscale=0.0)), eos_token_id=0, pad_token_id=1)["rope_parameters"]
    assert "mscale" not in rp and rp["mscale_all_dim"] == 0.7
    json.dumps(c)


@pytest.mark.parametrize("changes", [
    dict(norm_eps=1e-5, latent_norm_eps=1e-6),  # rms_norm_eps is free; the latent norms' is not
    dict(first_k_dense=0, dense_layers="0"),  # the same leading dense layer, said another way
    dict(shared_d_ff=16),  # = moe_d_ff x n_shared_experts
    dict(first_k_dense=3),  # no MoE layer at all
])
def test_equivalent_configs_export(changes):
    cfg = moe.ModelConfig(**{**MLA, **changes})
    assert unsupported_features(cfg) == []
    assert hf_config(cfg, eos_token_id=0, pad_token_id=1)["first_k_dense_replace"] == cfg.n_layers - cfg.n_moe_layers


@pytest.mark.parametrize("changes, feature", [
    (dict(norm_eps=1e-5), "model.norm_eps=1e-05 as the latent norms' eps"),
    (dict(latent_norm_eps=1e-5), "model.latent_norm_eps=1e-05 as the latent norms' eps"),
    (dict(dense_layers="2"), "model.dense_layers='2'"),
    (dict(moe_layer_step=2), "model.moe_layer_step=2"),
    (dict(router="softmax"), "model.router='softmax'"),
    (dict(router_group_score="max"), "model.router_group_score='max'"),
    (dict(n_routed_experts=1, top_k=1, n_group=1, topk_group=1), "fewer than 2 routed experts per group"),
    (dict(shared_d_ff=24), "model.shared_d_ff=24"),
    (dict(shared_expert_gate=True), "model.shared_expert_gate=True"),
    (dict(mask="prefix"), "prefix mask"),
    (dict(mask="bidirectional"), "bidirectional mask"),
    (dict(mask="mixed"), "mixed mask"),
])
def test_unsupported_features_refuse(tmp_path, tokenizer_path, changes, feature):
    cfg = moe.ModelConfig(**{**MLA, **changes})
    bad = unsupported_features(cfg)
    assert len(bad) == 1 and bad[0].startswith(feature), bad
    model = nnx.eval_shape(lambda: moe.Transformer(cfg, nnx.Rngs(0)))
    with pytest.raises(ExportError) as e:
        write_hf_checkpoint(model, str(tmp_path / "out"), tokenizer_path, "float32", CARD)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cannot export to HuggingFace DeepseekV3ForCausalLM: " + feature)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes, field", [
    (dict(rope=False), "model.rope"), (dict(qk_norm="head"), "model.qk_norm"), (dict(qkv_bias=True), "model.qkv_bias"),
    (dict(attn_out_bias=True), "model.attn_out_bias"), (dict(rope_fraction=0.5), "model.rope_fraction"),
])
def test_what_mla_cannot_be_never_reaches_the_export(changes, field):
    """NoPE, q/k norms, biases, partial RoPE: moe.config already refuses them with mla (the export's own check of
    them only guards a future relaxation)."""
    with pytest.raises(ConfigError, match=field):
        moe.ModelConfig(**{**MLA, **changes})
    unchecked = moe.ModelConfig(**MLA)
    object.__setattr__(unchecked, next(iter(changes)), next(iter(changes.values())))  # bypass the validation
    assert len(unsupported_features(unchecked)) == 1


def test_mtp_modules_export_as_deepseek_stores_them(tmp_path, tokenizer_path):
    """--mtp keep: layer n_layers holds the MTP module (num_nextn_predict_layers 1); transformers loads the main model
    with our logits and lists only that layer as unexpected; importing it back gives every parameter, the MTP
    module's included, bit for bit. --mtp drop: a plain DeepseekV3ForCausalLM, no unexpected keys."""
    torch, transformers = test_hf_export._hf()
    model = _model(dict(MLA, mtp_depth=1))
    keep, drop = tmp_path / "keep", tmp_path / "drop"
    write_hf_checkpoint(model, str(keep), tokenizer_path, "float32", CARD, max_position_embeddings=32)
    write_hf_checkpoint(model, str(drop), tokenizer_path, "float32", CARD, max_position_embeddings=32, mtp=False)
    assert json.loads((keep / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert json.loads((drop / "config.json").read_text())["num_nextn_predict_layers"] == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(keep), output_loading_info=True)
    assert not info["missing_keys"] and info["unexpected_keys"]
    assert all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    with torch.no_grad():
        theirs = hf(torch.tensor(TOKENS)).logits.float().numpy()
    ours = np.asarray(_forward(model, jnp.asarray(TOKENS))[0], np.float32)
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(ours).max()
    back, _ = load_hf_moe(str(keep))
    assert back.cfg.mtp_depth == 1
    a, b = flat_variables(model), flat_variables(back)
    assert sorted(a) == sorted(b) and any(k.startswith("mtp.0.") for k in a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    test_hf_export._hf_logits(str(drop), TOKENS)  # asserts no missing / unexpected keys
    assert load_hf_moe(str(drop))[0].cfg.mtp_depth == 0
