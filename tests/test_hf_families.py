"""HF import parity: for each MoE family, a tiny random transformers model saved with save_pretrained loads into
our model with the same logits (fp32) and the same expert ids in every MoE layer; what cannot be reproduced is
refused naming the field; the routing analysis runs on an imported model over a text file."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

torch = pytest.importorskip("torch", reason="torch builds the reference models")
transformers = pytest.importorskip("transformers", reason="transformers builds the reference models")
from tests.hf_random import hf_forward, ours_forward, random_hf  # noqa: E402

transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar on stderr

from analysis import hf_source  # noqa: E402
from analysis.routing import cli as routing  # noqa: E402
from moe import param_counts  # noqa: E402
from moe.hf import HFImportError, load_hf_moe, model_config  # noqa: E402
from moe.hf.common import read_config  # noqa: E402
from moe.hf.load import FAMILIES as LAYOUTS  # noqa: E402
from moe.hf.safetensors_io import flat_variables  # noqa: E402
from moe.hf.tensors import read_tensors  # noqa: E402
from moe.hf.weights import our_tensors  # noqa: E402

V = 320  # >= the test tokenizer's vocabulary
STACK = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             max_position_embeddings=256, hidden_act="silu")
TOKENS = np.random.RandomState(0).randint(2, V, (2, 12))

# Each family with its distinguishing options switched on (partial rotary, q/k norms, biases, dense layers ...).
FAMILIES = {
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **STACK, num_hidden_layers=3, head_dim=8, intermediate_size=48, first_k_dense_replace=1,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
        num_nextn_predict_layers=0),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **STACK, num_hidden_layers=3, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=False,
        qkv_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **STACK, num_hidden_layers=4, head_dim=12, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, decoder_sparse_step=2, norm_topk_prob=True, attention_bias=True,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "olmoe": lambda: transformers.OlmoeConfig(
        **STACK, num_hidden_layers=2, intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "mixtral": lambda: transformers.MixtralConfig(
        **STACK, num_hidden_layers=2, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


def _random_hf(name, seed=0):
    return random_hf(FAMILIES[name](), seed)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (name, HF directory, HF logits, HF expert ids); each family built once per module, on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = _random_hf(name)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(str(path))
            cache[name] = (name, str(path), *hf_forward(hf, TOKENS))
        return cache[name]

    return get


@pytest.fixture(params=list(FAMILIES))
def family(request, built):
    return built(request.param)


def test_logits_and_expert_ids_match(family):
    name, path, hf_logits, hf_ids = family
    model, tokenizer = load_hf_moe(path)
    assert tokenizer is None  # save_pretrained of a bare model writes no tokenizer
    ours, our_ids = ours_forward(model, jnp.asarray(TOKENS))
    ours = np.asarray(ours)
    scale = np.abs(hf_logits).max()
    err = np.abs(ours - hf_logits).max() / scale
    assert len(our_ids) == len(hf_ids) == model.cfg.n_moe_layers > 0
    agree = [np.mean(np.sort(np.asarray(a).reshape(-1, a.shape[-1]), -1) == np.sort(b, -1)) for a, b in
             zip(our_ids, hf_ids)]
    print(f"{name}: max |logit diff| / max |logit| = {err:.2e} (scale {scale:.2f}); expert-id agreement "
          f"{[float(a) for a in agree]}")
    assert err <= 1e-4, (name, err)
    assert all(a == 1.0 for a in agree), (name, agree)
    # Parameter accounting covers the new options (biases, q/k norms, shared width and gate, dense layers).
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert param_counts(model.cfg)["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert param_counts(model.cfg)["total"] == n_hf  # torch counts a tied head once, as we do


def _config_dict(name, **changes):
    c = FAMILIES[name]().to_dict()
    c.update(changes)
    return {k: v for k, v in c.items() if v != "DELETE"}


@pytest.mark.parametrize("name,changes,field", [
    ("glm4_moe", dict(model_type="deepseek_v4", compress_rates=[4]), "compress_rates"),  # DeepSeek-V4's attention
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window"),
    ("mixtral", dict(sliding_window=8), "sliding_window"),
    ("mixtral", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}), "rope_type"),
    ("qwen3_moe", dict(rope_parameters=None, rope_theta=500.0, rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_type"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ("olmoe", dict(hidden_act="gelu"), "hidden_act"),
    ("qwen2_moe", dict(num_experts=0, num_local_experts=0), "num_experts"),
    ("mixtral", dict(model_type="llama"), "model_type"),
    ("mixtral", dict(num_experts_per_tok="DELETE"), "num_experts_per_tok"),
    ("qwen3_moe", dict(num_attention_heads=3), "model.n_kv_heads"),  # our ConfigError, as an HFImportError
    # JSON types: Python reads "false" as true and "4" as a string (a key-head mismatch, once); each names its field
    ("qwen3_moe", dict(tie_word_embeddings="false"), "field 'tie_word_embeddings' is a string.*expected a boolean"),
    ("qwen2_moe", dict(norm_topk_prob="false"), "field 'norm_topk_prob' is a string.*expected a boolean"),
    ("olmoe", dict(attention_bias=1), "field 'attention_bias' is an integer .1.; expected a boolean"),
    ("qwen3_moe", dict(num_attention_heads="4"), "field 'num_attention_heads' is a string .\"4\".; expected an "
                                                 "integer"),
    ("glm4_moe", dict(hidden_size=32.0), "field 'hidden_size' is a number .32.0.; expected an integer"),
    ("mixtral", dict(num_experts_per_tok=True), "field 'num_experts_per_tok' is the boolean true; expected an "
                                                "integer"),
    ("glm4_moe", dict(rms_norm_eps="1e-5"), "field 'rms_norm_eps' is a string.*expected a number"),
    ("qwen2_moe", dict(mlp_only_layers=["1"]), "field 'mlp_only_layers' is a list.*expected a list of integers"),
    ("qwen3_moe", dict(num_hidden_layers=None), "field 'num_hidden_layers' is null; expected an integer"),
    ("glm4_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": "500"}),
     "field 'rope_parameters.rope_theta' is a string.*expected a number"),
    ("mixtral", dict(model_type=["mixtral"]), "field 'model_type' is a list.*expected a string"),
])
def test_refused_configs_name_the_field(name, changes, field):
    with pytest.raises(HFImportError, match=field) as e:
        model_config(_config_dict(name, **changes))
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("name,tensor,stored", [
    ("qwen2_moe", "model.layers.0.self_attn.o_proj.weight", lambda w: w.reshape(-1)),  # 1-D, right count
    ("qwen2_moe", "model.layers.0.self_attn.k_proj.weight", lambda w: w.reshape(w.shape[1], w.shape[0])),
    ("qwen2_moe", "model.layers.0.self_attn.k_proj.bias", lambda b: b.reshape(2, -1)),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight", lambda w: w.reshape(-1)),
    ("glm4_moe", "model.layers.0.mlp.down_proj.weight", lambda w: w.T),  # the dense SwiGLU, transposed
    ("olmoe", "model.layers.0.self_attn.k_norm.weight", lambda w: w.reshape(1, -1)),
    ("mixtral", "model.layers.0.block_sparse_moe.gate.weight", lambda w: w.T),
])
def test_a_tensor_of_the_right_size_but_the_wrong_shape_is_refused(built, name, tensor, stored):
    """Every tensor's full HF shape ([out, in] for a Linear) is checked before it is read: a transposed or
    flattened tensor with the right number of elements would otherwise load into a wrong model."""
    _, path, _, _ = built(name)
    c, where = read_config(path)
    sd = read_tensors(path)
    want = list(sd[tensor].shape)
    sd[tensor] = stored(sd[tensor])
    with pytest.raises(HFImportError, match=f"tensor '{tensor}' is {list(sd[tensor].shape)}.*needs {want}".replace(
            "[", r"\[").replace("]", r"\]")):
        our_tensors(model_config(c), LAYOUTS[name].layout(c), sd, where)


def test_a_tied_config_with_a_different_stored_head_loads_as_transformers_does(built, tmp_path):
    """tie_word_embeddings true but lm_head.weight stored and different: transformers 5.x does not tie them and
    uses the stored head (its logits differ from the tied model's); ours too. An identical stored copy stays tied."""
    _, path, _, _ = built("qwen3_moe")
    sd = read_tensors(path)
    assert "lm_head.weight" not in sd and json.loads((Path(path) / "config.json").read_text())["tie_word_embeddings"]
    shutil.copy(Path(path) / "config.json", tmp_path / "config.json")
    for head, tied in ((sd["model.embed_tokens.weight"] + 0.25, False), (sd["model.embed_tokens.weight"], True)):
        save_file({**sd, "lm_head.weight": head}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
        assert np.array_equal(hf.lm_head.weight.detach().numpy(), head)  # what transformers computes with
        hf_logits, _ = hf_forward(hf, TOKENS)
        model, _ = load_hf_moe(str(tmp_path))
        ours = np.asarray(ours_forward(model, jnp.asarray(TOKENS))[0])
        assert model.cfg.tie_embeddings == tied
        np.testing.assert_allclose(ours, hf_logits, atol=1e-4 * np.abs(hf_logits).max())
    c, where = read_config(path)  # the lower-level mapping, told the model is tied, refuses the differing head
    with pytest.raises(HFImportError, match="tie_word_embeddings is true but tensor 'lm_head.weight' differs"):
        our_tensors(model_config(c), LAYOUTS["qwen3_moe"].layout(c), {**sd, "lm_head.weight": sd[
            "model.embed_tokens.weight"] + 0.25}, where)


def test_inactive_sliding_window_is_accepted():
    """A Mixtral window at least max_position_embeddings long never masks anything: same model."""
    cfg = model_config(_config_dict("mixtral", sliding_window=256))
    assert cfg == model_config(_config_dict("mixtral"))


def _fused(sd, gate, up, down):
    """transformers 5.x's in-memory layout: experts.gate_up_proj [E, 2F, D] and experts.down_proj [E, D, F]."""
    out, experts = {}, {}
    for k, v in sd.items():
        head, sep, tail = k.partition(".experts.")
        if not sep:
            out[k.replace("block_sparse_moe", "mlp")] = v
            continue
        e, w, _ = tail.split(".")
        experts.setdefault(head.replace("block_sparse_moe", "mlp"), {}).setdefault(w, {})[int(e)] = v
    for head, ws in experts.items():
        E = len(ws[gate])
        out[head + ".experts.gate_up_proj"] = np.stack(
            [np.concatenate([ws[gate][e], ws[up][e]], 0) for e in range(E)])
        out[head + ".experts.down_proj"] = np.stack([ws[down][e] for e in range(E)])
    return out


def test_fused_expert_layout_reads_the_same(family):
    name, path, _, _ = family
    c, where = read_config(path)
    cfg, layout = model_config(c), LAYOUTS[c["model_type"]].layout(c)
    sd = read_tensors(path)
    per_expert = our_tensors(cfg, layout, dict(sd), where)
    fused = our_tensors(cfg, layout, _fused(sd, *layout.experts), where)
    assert per_expert.keys() == fused.keys()
    for k in per_expert:
        np.testing.assert_array_equal(per_expert[k], fused[k], err_msg=k)
    model, _ = load_hf_moe(path)
    assert flat_variables(model).keys() == per_expert.keys()


def test_glm_mtp_layers_are_skipped(built):
    _, path, _, _ = built("glm4_moe")
    sd = read_tensors(path)
    sd["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)  # an MTP layer's tensor
    c, where = read_config(path)
    with pytest.raises(HFImportError, match="unexpected tensor.*model.layers.3.eh_proj"):
        our_tensors(model_config(c), LAYOUTS["glm4_moe"].layout(c), dict(sd), where)
    c["num_nextn_predict_layers"] = 1
    assert "blocks.3.attn.wq" not in our_tensors(model_config(c), LAYOUTS["glm4_moe"].layout(c), sd, where)


def test_missing_tensor_is_one_line(built, tmp_path):
    _, path, _, _ = built("olmoe")
    sd = read_tensors(path)
    del sd["model.layers.1.self_attn.q_norm.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(_config_dict("olmoe")))
    with pytest.raises(HFImportError, match="q_norm.weight' missing"):
        load_hf_moe(str(tmp_path))


@pytest.fixture(scope="module")
def analysable(built, tmp_path_factory):
    """The Qwen2-MoE directory plus a tokenizer.json (byte-level BPE, < V tokens) and two text files."""
    _, path, _, _ = built("qwen2_moe")
    root = tmp_path_factory.mktemp("analysable")
    hf_dir = root / "hf"
    shutil.copytree(path, hf_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. def f(x): return x + 1"] * 20, trainer)
    tok.save(str(hf_dir / "tokenizer.json"))
    (root / "prose.txt").write_text("The quick brown fox jumps over the lazy dog, again and again.\n" * 30)
    (root / "code.txt").write_text("def f(x):\n    return x + 1\n\nprint(f(2), f(3))\n" * 30)
    return hf_dir, root


def test_routing_analysis_of_an_imported_model(analysable, tmp_path):
    hf_dir, root = analysable
    out = tmp_path / "out"
    a, written = routing.run(routing.parse_args([
        "--hf", str(hf_dir), "--text", str(root / "prose.txt"), "--text", str(root / "code.txt"), "--out", str(out),
        "--seq_len", "32", "--batch_size", "4", "--no_progress", "--token", " the", "--token", "return"]),
        log=lambda *_: None)
    assert written == out and not (hf_dir / "analysis").exists()  # the model directory is left untouched
    doc = json.loads((out / "routing.json").read_text())
    assert doc["domains"] == ["prose", "code"] and doc["model_type"] == "qwen2_moe" and doc["split"] == "text"
    assert doc["layer_ids"] == [0, 2] and doc["n_experts"] == 8 and doc["top_k"] == 2  # layer 1 is dense
    assert a.n_tokens == int(a.result["n_tokens_D"].sum()) > 0
    np.testing.assert_allclose(a.result["share_LxDxE"].sum(-1), 2.0, atol=1e-5)  # every token picks K = 2
    assert (out / "tokens.html").is_file() and (out / "domain_heatmap.png").is_file()


@pytest.mark.parametrize("extra,expected", [
    (["--step", "3"], "--step needs --workdir"),
    (["--text", "a.txt", "--split", "validation"], "exclude each other"),
    (["--text", "missing.txt"], "--text missing.txt: no such file"),
    (["--workdir", "x"], "not allowed with argument"),
])
def test_hf_flags_bad_input_one_line(analysable, tmp_path, capsys, extra, expected):
    hf_dir, _ = analysable
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        routing.main(["--hf", str(hf_dir), "--out", str(tmp_path), "--no_progress", *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and expected in err and "\n" not in err, err


def test_hf_without_tokenizer_or_out_is_refused(built, tmp_path, capsys):
    _, path, _, _ = built("mixtral")
    for argv, expected in ((["--hf", path, "--out", str(tmp_path)], "no tokenizer.json"),
                           (["--hf", path], "--out is required with --hf")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            routing.main([*argv, "--no_progress"])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and expected in err and "\n" not in err, err


def test_bundled_corpus_is_retokenized_with_the_models_tokenizer(analysable):
    """Without --text the corpus's split is tokenized with the model's tokenizer.json (its own token cache), and
    documents are separated by the model's EOS (config.json has none here: the tokenizer's <|endoftext|>)."""
    hf_dir, _ = analysable
    src = hf_source.open_source(hf_dir, split="validation", seq_len=32)
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert len(src.cache.domain_names) == 9 and "code" in src.cache.domain_names and src.split == "validation"
    assert src.cache.eos_id == tok.token_to_id("<|endoftext|>") and src.run.moe_layer_ids == [0, 2]
    first = np.asarray(src.cache.tokens[src.cache.offsets[0]:src.cache.offsets[1]])
    text = tok.decode(first.tolist())
    assert tok.encode(text, add_special_tokens=False).ids == first.tolist()
