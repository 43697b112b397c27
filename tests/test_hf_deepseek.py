"""HF import parity for the multi-head latent attention families (moe/hf/deepseek.py): a tiny random transformers
deepseek_v2 (greedy, and group_limited_greedy; no query LoRA as V2-Lite), deepseek_v3 (query LoRA, 4 groups, YaRN,
interleaved RoPE, an MTP layer in the checkpoint, imported as our MTP module) and glm4_moe_lite (rotate-half RoPE, a dense layer after a MoE one),
saved with save_pretrained, loads with the same logits (fp32), the same experts in every MoE layer, and decodes with
our latent KV cache the same 32 greedy tokens as transformers' generate; what it cannot reproduce is refused naming
the field."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
from tests.hf_random import EX, hf_forward, ours_forward, random_hf  # noqa: E402

transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar on stderr

from analysis.routing import cli as routing  # noqa: E402
from moe import param_counts  # noqa: E402
from moe.decoding.generate import generate  # noqa: E402
from moe.hf import HFImportError, load_hf_moe, model_config  # noqa: E402
from moe.hf.common import read_config, rope_parameters  # noqa: E402
from moe.hf.load import FAMILIES as LAYOUTS  # noqa: E402
from moe.hf.tensors import read_tensors  # noqa: E402
from moe.hf.weights import our_tensors  # noqa: E402

V = 128
# No special tokens: transformers' generate would stop at an EOS that our fixed-length decode runs past.
STACK = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
             max_position_embeddings=64, hidden_act="silu", intermediate_size=96, moe_intermediate_size=32,
             n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
             v_head_dim=10, eos_token_id=None, bos_token_id=None, pad_token_id=None)
# YaRN past its original 16 positions (the decode runs to 37); mscale != mscale_all_dim: cos/sin scaled too.
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}
# transformers' latent RMSNorms (q_a_layernorm, kv_a_layernorm) keep eps 1e-6 whatever rms_norm_eps is: a large one
# makes taking rms_norm_eps there visible in the logits.
LARGE_EPS = dict(STACK, rms_norm_eps=0.25)
TOKENS = np.random.RandomState(0).randint(0, V, (2, 12))
N_NEW = 32

FAMILIES = {
    "deepseek_v2_greedy": lambda: transformers.DeepseekV2Config(
        **STACK, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=None, n_shared_experts=1,
        topk_method="greedy", routed_scaling_factor=1.5, rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707)),
    "deepseek_v2_group_limited": lambda: transformers.DeepseekV2Config(
        **STACK, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=None, n_shared_experts=2,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.0,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **LARGE_EPS, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=24, n_shared_experts=1, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True, rope_parameters=YARN,
        num_nextn_predict_layers=1),
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        **LARGE_EPS, num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "dense", "sparse"], q_lora_rank=24,
        n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
        rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


def _random_hf(name, seed=0):
    return random_hf(FAMILIES[name](), seed)


def _hf_generate(hf, prompt):
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt), attention_mask=torch.ones_like(torch.tensor(prompt)),
                          do_sample=False, max_new_tokens=N_NEW)
    return out[:, prompt.shape[1]:].numpy()


def _add_mtp_layer(path, sd, n_layers):
    """What DeepSeek-V3 checkpoints hold after the last layer (transformers' save_pretrained writes none), as
    model.layers.{n_layers}.*: a decoder layer (the last one's weights, perturbed), random enorm, hnorm, eh_proj and
    shared_head.norm, and copies of the embedding and head."""
    last, mtp = f"model.layers.{n_layers - 1}.", f"model.layers.{n_layers}."
    rng = np.random.default_rng(7)
    extra = {mtp + k[len(last):]: (v * (1 + 0.1 * rng.standard_normal(v.shape))).astype(np.float32)
             for k, v in sd.items() if k.startswith(last)}
    D = STACK["hidden_size"]
    extra.update({mtp + "enorm.weight": 1 + 0.3 * rng.standard_normal(D).astype(np.float32),
                  mtp + "hnorm.weight": 1 + 0.3 * rng.standard_normal(D).astype(np.float32),
                  mtp + "eh_proj.weight": 0.1 * rng.standard_normal((D, 2 * D)).astype(np.float32),
                  mtp + "shared_head.norm.weight": 1 + 0.3 * rng.standard_normal(D).astype(np.float32),
                  mtp + "embed_tokens.weight": sd["model.embed_tokens.weight"],
                  mtp + "shared_head.head.weight": sd["lm_head.weight"]})
    save_file({**sd, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return sorted(extra)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> dict(path, hf logits, hf expert ids, hf greedy tokens, our model, hf parameter count); once per
    module per family, on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = _random_hf(name)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(str(path))
            mtp = []
            if hf.config.to_dict().get("num_nextn_predict_layers"):
                mtp = _add_mtp_layer(path, read_tensors(str(path)), hf.config.num_hidden_layers)
            logits, ids = hf_forward(hf, TOKENS)
            model, tokenizer = load_hf_moe(str(path))
            assert tokenizer is None  # save_pretrained of a bare model writes no tokenizer
            cache[name] = dict(path=str(path), logits=logits, ids=ids, tokens=_hf_generate(hf, TOKENS[:, :5]),
                               model=model, n_params=sum(p.numel() for p in hf.parameters()), mtp=mtp)
        return cache[name]

    return get


@pytest.fixture(params=list(FAMILIES))
def family(request, built):
    return request.param, built(request.param)


def test_logits_and_expert_ids_match(family):
    name, f = family
    model = f["model"]
    ours, our_ids = ours_forward(model, jnp.asarray(TOKENS))
    scale = np.abs(f["logits"]).max()
    err = np.abs(np.asarray(ours) - f["logits"]).max() / scale
    assert len(our_ids) == len(f["ids"]) == model.cfg.n_moe_layers > 0
    agree = [np.mean(np.sort(np.asarray(a).reshape(-1, a.shape[-1]), -1) == np.sort(b, -1)) for a, b in
             zip(our_ids, f["ids"])]
    print(f"{name}: max |logit diff| = {err * scale:.2e}, / max |logit| = {err:.2e} (scale {scale:.2f}); "
          f"expert-id agreement {[float(a) for a in agree]}")
    assert err <= 1e-4, (name, err)
    assert all(a == 1.0 for a in agree), (name, agree)
    assert param_counts(model.cfg)["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    main = dataclasses.replace(model.cfg, mtp_depth=0)  # transformers' model holds no MTP layer
    assert param_counts(main)["total"] == f["n_params"]


def test_greedy_decoding_matches_generate(family):
    """32 new tokens from a 5-token prompt, 2 rows: our prefill + one-token steps over the latent cache (the
    absorbed form) against transformers' generate(do_sample=False) with its own cache."""
    name, f = family
    ours = np.asarray(generate(f["model"], jnp.asarray(TOKENS[:, :5]), jax.random.key(0), execution=EX, max_new_tokens=N_NEW,
                               temperature=0.0))
    assert f["tokens"].shape == (2, N_NEW)
    np.testing.assert_array_equal(ours, f["tokens"], err_msg=name)


def test_what_each_family_maps_to(built):
    """The distinguishing fields land where they should (the parity tests above would pass vacuously otherwise)."""
    cfgs = {name: built(name)["model"].cfg for name in FAMILIES}
    v2, v2g, v3, lite = (cfgs[k] for k in FAMILIES)
    assert v2.router == v2g.router == "softmax" and not v2.norm_topk_prob and v2.n_group == 1
    assert (v2g.n_group, v2g.topk_group, v2g.router_group_score) == (4, 2, "max")
    assert v2.q_lora_rank == 0 and v2.rope_interleave and v2.rope_scaling_factor == 4.0
    assert v2.yarn_mscale == v2.yarn_mscale_all_dim == 0.707 and v2g.rope_scaling_factor == 1.0
    assert v3.router == "sigmoid" and (v3.n_group, v3.topk_group, v3.router_group_score) == (4, 2, "top2_sum")
    assert v3.q_lora_rank == 24 and v3.rope_interleave and v3.rope_original_max_position == 16
    assert (lite.first_k_dense, lite.dense_layers, lite.moe_layer_ids) == (1, "2", (1, 3))
    assert not lite.rope_interleave and lite.attention == "mla"
    assert lite.norm_eps == 0.25 and all(c.latent_norm_eps == 1e-6 for c in cfgs.values())


def test_mtp_layer_is_imported_and_equals_the_papers_module(built, tmp_path):
    """DeepSeek-V3's layer num_hidden_layers becomes our MTP module: its depth-1 loss equals the paper's equations
    computed in torch (transformers' own decoder layer for the block; h^0 the final-normed hidden state; the
    embedding first in eh_proj's input)."""
    f = built("deepseek_v3")
    assert "model.layers.3.eh_proj.weight" in f["mtp"] and "model.layers.3.self_attn.kv_b_proj.weight" in f["mtp"]
    model, sd = f["model"], read_tensors(f["path"])
    assert model.cfg.mtp_depth == 1 and model.cfg.train_load_layer_ids == (1, 2, 3)
    hf = _random_hf("deepseek_v3")
    cfg4 = FAMILIES["deepseek_v3"]()
    cfg4.num_hidden_layers = 4  # the same weights plus layer 3, the MTP layer's decoder layer
    cfg4.save_pretrained(str(tmp_path))
    save_file({k: v for k, v in sd.items() if not k.startswith("model.layers.3.") or "self_attn" in k or "mlp" in k
               or "layernorm" in k}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf4 = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path)).eval()
    p = "model.layers.3."
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 0.25) * torch.tensor(sd[p + w])
    tok = torch.tensor(TOKENS)
    with torch.no_grad():
        h0 = hf.model(tok).last_hidden_state[:, :-1]
        emb = hf.model.embed_tokens(tok[:, 1:])
        x = torch.cat([rms(emb, "enorm.weight"), rms(h0, "hnorm.weight")], -1) @ torch.tensor(sd[p + "eh_proj.weight"]).T
        got = {}
        pre = hf4.model.layers[3].register_forward_pre_hook(lambda _m, args, kw: ((x,), kw), with_kwargs=True)
        post = hf4.model.layers[3].register_forward_hook(lambda _m, _a, out: got.update(h=out))
        hf4.model(tok[:, :-1])
        pre.remove(), post.remove()
        h = got["h"][0] if isinstance(got["h"], tuple) else got["h"]
        logits = rms(h, "shared_head.norm.weight") @ torch.tensor(sd["lm_head.weight"]).T
        ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), tok[:, 2:].reshape(-1),
                                                reduction="none").reshape(2, -1).numpy()
    _, aux = nnx.jit(lambda m, t, y: m.token_losses(t, y, mtp=True))(model, TOKENS[:, :-1], TOKENS[:, 1:])
    ours = np.asarray(aux.mtp.ce[0])[:, :ref.shape[1]]
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)


def test_mtp_copies_that_differ_from_the_main_embedding_are_refused(built):
    f = built("deepseek_v3")
    c, where = read_config(f["path"])
    sd = read_tensors(f["path"])
    cfg = dataclasses.replace(model_config(c), mtp_depth=1)
    sd["model.layers.3.shared_head.head.weight"] = sd["model.layers.3.shared_head.head.weight"] + 1.0
    with pytest.raises(HFImportError, match="shared_head.head.weight' differs from 'lm_head.weight'"):
        our_tensors(cfg, LAYOUTS["deepseek_v3"].layout(c), sd, where)
    c["num_nextn_predict_layers"] = 0  # without the field the extra layer is an unknown feature: refused
    with pytest.raises(HFImportError, match="unexpected tensor.*model.layers.3"):
        our_tensors(model_config(c), LAYOUTS["deepseek_v3"].layout(c), read_tensors(f["path"]), where)


def test_a_config_claiming_fewer_layers_than_stored_is_refused(built, tmp_path):
    """Layers at or past num_hidden_layers are MTP layers only when they hold an eh_proj: a config claiming 2 of
    the 3 decoder layers stored (plus the MTP layer) is refused with num_nextn_predict_layers set, not loaded as a
    truncated model, and refused without it."""
    f = built("deepseek_v3")
    shutil.copytree(f["path"], tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for nextn in (1, 0):
        (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=2,
                                                                     num_nextn_predict_layers=nextn)))
        with pytest.raises(HFImportError, match=r"num_hidden_layers is 2 but the weights hold model\.layers\.0-3, "
                                                r"1 of them MTP layers") as e:
            load_hf_moe(str(tmp_path / "hf"))
        assert "unexpected tensor(s) 'model.layers.2." in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("tensor,stored", [
    ("model.layers.1.self_attn.kv_b_proj.weight", lambda w: np.ascontiguousarray(w.T)),  # [R, H*(Dn+Dv)]
    ("model.layers.1.self_attn.o_proj.weight", lambda w: w.reshape(-1)),  # 1-D, right count
    ("model.layers.0.self_attn.q_b_proj.weight", lambda w: w.reshape(w.shape[1], w.shape[0])),
    ("model.layers.1.mlp.experts.3.down_proj.weight", lambda w: np.ascontiguousarray(w.T)),
    ("model.layers.1.mlp.shared_experts.up_proj.weight", lambda w: np.ascontiguousarray(w.T)),
    ("model.layers.1.self_attn.kv_a_layernorm.weight", lambda w: w.reshape(2, -1)),
    ("model.layers.3.eh_proj.weight", lambda w: np.ascontiguousarray(w.T)),  # the MTP layer's [D, 2D]
])
def test_a_tensor_of_the_right_size_but_the_wrong_shape_is_refused(built, tensor, stored):
    f = built("deepseek_v3")
    c, where = read_config(f["path"])
    sd = read_tensors(f["path"])
    want = list(sd[tensor].shape)
    sd[tensor] = stored(sd[tensor])
    cfg = dataclasses.replace(model_config(c), mtp_depth=1)
    with pytest.raises(HFImportError, match=f"tensor '{tensor}' is {list(sd[tensor].shape)}, the config in "
                                            f"config.json needs {want}".replace("[", r"\[").replace("]", r"\]")):
        our_tensors(cfg, LAYOUTS["deepseek_v3"].layout(c), sd, where)


def _config_dict(name, **changes):
    c = FAMILIES[name]().to_dict()
    c.update(changes)
    return {k: v for k, v in c.items() if v != "DELETE"}


def test_rope_parameters_read_as_transformers_reads_them():
    """4.x configs (DeepSeek-V2-Lite, Moonlight: `rope_scaling` with `type`, top-level rope_theta) map to the same
    model as the 5.x `rope_parameters` that transformers converts them to."""
    for name in FAMILIES:
        new = _config_dict(name)
        rp = dict(new["rope_parameters"])
        rope_type = rp.pop("rope_type")
        old = _config_dict(name, rope_parameters="DELETE", rope_theta=rp.pop("rope_theta"),
                           rope_scaling=dict(rp, type=rope_type) if rope_type != "default" else None)
        assert model_config(old) == model_config(new), name
        hf_rp = type(FAMILIES[name]()).from_dict(old).rope_parameters
        assert rope_parameters(old) == {**hf_rp, "rope_type": rope_type}, name


@pytest.mark.parametrize("name,changes,field", [
    ("deepseek_v3", dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}), "quantization_config"),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}), "rope_type"),
    ("deepseek_v2_greedy", dict(rope_parameters="DELETE", rope_theta=500.0,
                                rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type"),
    ("deepseek_v3", dict(rope_parameters=dict(YARN, attention_factor=1.2)), "attention_factor"),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                          "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    ("deepseek_v3", dict(model_type="deepseek_v32", index_topk=0), "index_topk"),  # imported up to index_topk
    ("deepseek_v3", dict(index_topk=64, index_n_heads=2, index_head_dim=8), "index_topk"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias"),
    ("deepseek_v2_greedy", dict(mlp_bias=True), "mlp_bias"),
    ("glm4_moe_lite", dict(hidden_act="gelu"), "hidden_act"),
    ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads"),
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func"),
    ("deepseek_v3", dict(topk_method="group_limited_greedy"), "topk_method"),
    ("deepseek_v2_greedy", dict(topk_method="noaux_tc"), "topk_method"),
    ("deepseek_v2_greedy", dict(norm_topk_prob=True), "norm_topk_prob"),
    ("deepseek_v2_greedy", dict(moe_layer_freq=2), "moe_layer_freq"),
    ("glm4_moe_lite", dict(first_k_dense_replace=2), "first_k_dense_replace"),
    ("glm4_moe_lite", dict(head_dim=16), "head_dim"),
    ("deepseek_v3", dict(qk_rope_head_dim="DELETE"), "qk_rope_head_dim"),
    # JSON types (Python reads "false" as true) and YaRN settings that used to fail inside Python
    ("deepseek_v3", dict(norm_topk_prob="false"), "field 'norm_topk_prob' is a string.*expected a boolean"),
    ("deepseek_v3", dict(rope_interleave="false"), "field 'rope_interleave' is a string.*expected a boolean"),
    ("glm4_moe_lite", dict(mlp_layer_types="dense"), "field 'mlp_layer_types' is a string.*list of strings"),
    ("deepseek_v2_greedy", dict(q_lora_rank="none"), "field 'q_lora_rank' is a string.*expected an integer"),
    ("deepseek_v3", dict(rope_parameters=dict(YARN, beta_fast="32")), "'rope_parameters.beta_fast' is a string"),
    ("deepseek_v3", dict(rope_parameters="DELETE", rope_scaling="yarn"),
     "field 'rope_scaling' is a string .\"yarn\".; expected an object"),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 500.0}, max_position_embeddings=0),
     "max_position_embeddings=0 is not supported .YaRN needs the context length"),
    ("deepseek_v3", dict(rope_parameters=dict(YARN, original_max_position_embeddings=-16)),
     "rope_parameters.original_max_position_embeddings=-16"),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 500.0,
                                          "original_max_position_embeddings": 128}),
     "max_position_embeddings=64 .*must be >= 1"),
    ("deepseek_v3", dict(rope_parameters=dict(YARN, factor=0.5)), "rope_parameters.factor=0.5"),
])
def test_refused_configs_name_the_field(name, changes, field):
    with pytest.raises(HFImportError, match=field) as e:
        model_config(_config_dict(name, **changes))
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)


WORDS = "the quick brown fox jumps over lazy dog def return print x y again".split()


@pytest.mark.parametrize("name", ["deepseek_v2_group_limited", "deepseek_v3", "glm4_moe_lite"])
def test_routing_analysis_runs_on_each_family(built, name, tmp_path):
    """analysis.routing --hf on each MLA family's checkpoint, with a word-level tokenizer inside its vocabulary."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(built(name)["path"], hf_dir)
    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<|pad|>", "[UNK]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(hf_dir / "tokenizer.json"))
    (tmp_path / "prose.txt").write_text("the quick brown fox jumps over the lazy dog again\n" * 20)
    (tmp_path / "code.txt").write_text("def x return y print x\n" * 20)
    out = tmp_path / "out"
    a, _ = routing.run(routing.parse_args([
        "--hf", str(hf_dir), "--text", str(tmp_path / "prose.txt"), "--text", str(tmp_path / "code.txt"),
        "--out", str(out), "--seq_len", "16", "--batch_size", "4", "--no_progress", "--token", "the", "--token", "x"]),
        log=lambda *_: None)
    doc = json.loads((out / "routing.json").read_text())
    model = built(name)["model"]
    assert doc["model_type"] == name.removesuffix("_group_limited") and doc["domains"] == ["prose", "code"]
    assert doc["layer_ids"] == list(model.cfg.moe_layer_ids) and a.n_tokens > 0
    np.testing.assert_allclose(a.result["share_LxDxE"].sum(-1), 2.0, atol=1e-5)  # top-2 of the imported router
