"""HF export: Glm4MoeForCausalLM loads our checkpoint with no missing/unexpected weights and gives our logits
and our greedy tokens (fp32); unsupported features refuse to export; the tokenizer loads with AutoTokenizer."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import moe
from moe.decoding.generate import generate
from moe.hf.write import (
    ExportError,
    hf_config,
    hf_state_dict,
    special_token_ids,
    unsupported_features,
    write_hf_checkpoint,
)
from tests.model_fixtures import ragged_execution

EX = ragged_execution()  # the export is the subject, not the experts' kernel (tests/hf_random.py)
V = 320  # >= the test tokenizer's vocabulary
BASE = dict(vocab_size=V, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, first_k_dense=1,
            n_routed_experts=8, n_shared_experts=2, top_k=2, moe_d_ff=16, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, rope_theta=500.0, norm_eps=1e-5, init_std=0.3)
CARD = {"name": "tiny-moe", "data": "test strings", "steps": 10, "final_val_loss": 5.25}


def _hf():
    torch = pytest.importorskip("torch", reason="torch is needed to load the export with transformers")
    transformers = pytest.importorskip("transformers", reason="transformers is needed to load the export")
    return torch, transformers


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, said the mixture of experts"] * 20,
                            trainer)
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok.save(path)
    return path


@nnx.jit
def _forward(model, tokens):
    logits, aux = model(tokens, return_routing=True, execution=EX)
    return logits, [r["expert_ids"] for r in aux["routing"]]


def _model(**changes):
    cfg = moe.ModelConfig(**{**BASE, **changes})
    model = moe.Transformer(cfg, nnx.Rngs(0))
    E = cfg.n_routed_experts
    rng = np.random.RandomState(1)
    # Biases of the size of the score spread (sigmoid in (0, 1)), so they change which experts are chosen.
    moe.set_routing_biases(model, [jnp.asarray(rng.uniform(-0.5, 0.5, E), jnp.float32)
                                   for _ in range(cfg.n_moe_layers)])
    return model


TOKENS = np.random.RandomState(0).randint(2, V, (2, 12))


@pytest.fixture(scope="module")
def untied():
    return _model()


def _hf_logits(path, tokens):
    torch, transformers = _hf()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return hf, hf(torch.tensor(tokens)).logits.float().numpy()


def _assert_parity(model, path):
    ours, _ = _forward(model, jnp.asarray(TOKENS))
    ours = np.asarray(ours, np.float32)
    hf, theirs = _hf_logits(path, TOKENS)
    scale = np.abs(ours).max()
    assert np.abs(ours - theirs).max() <= 1e-4 * scale, (np.abs(ours - theirs).max(), scale)
    return hf


@pytest.mark.parametrize("tie", [False, True])
def test_logit_parity(tmp_path, tokenizer_path, untied, tie):
    model = untied if not tie else _model(tie_embeddings=True)
    # The biases must matter: without them, other experts win somewhere.
    _, ids_biased = _forward(model, jnp.asarray(TOKENS))
    saved = moe.routing_biases(model)
    moe.set_routing_biases(model, [jnp.zeros_like(b) for b in saved])
    _, ids_plain = _forward(model, jnp.asarray(TOKENS))
    moe.set_routing_biases(model, saved)
    assert any(not np.array_equal(a, b) for a, b in zip(ids_biased, ids_plain))

    files = write_hf_checkpoint(model, str(tmp_path), tokenizer_path, "float32", CARD)
    assert ("lm_head.weight" in hf_state_dict(model)) is not tie
    assert set(files) <= set(os.listdir(tmp_path))
    hf = _assert_parity(model, str(tmp_path))
    assert hf.config.tie_word_embeddings is tie
    assert hf.config.rope_parameters["partial_rotary_factor"] == 1.0 and hf.config.num_mtp_layers == 0


def test_greedy_generation_parity(tmp_path, tokenizer_path, untied):
    torch, transformers = _hf()
    write_hf_checkpoint(untied, str(tmp_path), tokenizer_path, "float32", CARD)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    prompt, n = TOKENS[:1, :6], 10
    ours = np.asarray(generate(untied, jnp.asarray(prompt), jax.random.key(0), execution=EX, max_new_tokens=n,
                               temperature=0.0))
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt), attention_mask=torch.ones_like(torch.tensor(prompt)),
                          do_sample=False, max_new_tokens=n)
    theirs = out[0, prompt.shape[1]:].numpy()
    # HF stops at <|endoftext|> (id 0); up to there the tokens must agree.
    assert len(theirs) == n or theirs[-1] == 0
    np.testing.assert_array_equal(ours[0, :len(theirs)], theirs)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # HF's width-0 shared experts
def test_sharded_and_no_shared_experts(tmp_path, tokenizer_path):
    model = _model(n_shared_experts=0, first_k_dense=0, n_group=1, topk_group=1, norm_topk_prob=False)
    files = write_hf_checkpoint(model, str(tmp_path), tokenizer_path, "float32", CARD, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(shards) <= set(files) and not (tmp_path / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(hf_state_dict(model))
    _assert_parity(model, str(tmp_path))


def test_bfloat16_export_loads(tmp_path, tokenizer_path, untied):
    torch, transformers = _hf()
    write_hf_checkpoint(untied, str(tmp_path), tokenizer_path, "bfloat16", CARD)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert hf.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_tokenizer_and_card(tmp_path, tokenizer_path, untied):
    _, transformers = _hf()
    write_hf_checkpoint(untied, str(tmp_path), tokenizer_path, "float32", CARD)
    ours = Tokenizer.from_file(tokenizer_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["the quick brown fox", "mixture of experts<|endoftext|>zebra!", " lazy  dog\n"]:
        ids = ours.encode(text).ids
        assert theirs(text)["input_ids"] == ids
        assert theirs.decode(ids) == ours.decode(ids, skip_special_tokens=False)
    assert (theirs.eos_token, theirs.eos_token_id, theirs.pad_token, theirs.pad_token_id) == (
        "<|endoftext|>", 0, "<|pad|>", 1)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (0, 1)
    card = (tmp_path / "README.md").read_text()
    counts = moe.param_counts(untied.cfg)
    assert f"{counts['total']:,}" in card and f"{counts['active']:,}" in card and "5.25" in card


def test_hf_config_fields():
    cfg = moe.ModelConfig(**BASE)
    c = hf_config(cfg, eos_token_id=0, pad_token_id=1)
    assert c["model_type"] == "glm4_moe" and c["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert (c["head_dim"], c["n_group"], c["topk_group"], c["num_nextn_predict_layers"]) == (8, 4, 2, 0)
    assert (c["intermediate_size"], c["moe_intermediate_size"], c["first_k_dense_replace"]) == (64, 16, 1)
    assert c["use_qk_norm"] is False and c["attention_bias"] is False and c["tie_word_embeddings"] is False


@pytest.mark.parametrize("changes, feature", [
    (dict(mask="prefix"), "prefix mask"),
    (dict(mask="bidirectional"), "bidirectional mask"),
    (dict(mask="mixed"), "mixed mask"),
    (dict(rope=False), "no position encoding (NoPE)"),
])
def test_unsupported_features_refuse(tmp_path, tokenizer_path, changes, feature):
    cfg = moe.ModelConfig(**{**BASE, **changes})
    assert unsupported_features(cfg) == [feature]
    model = nnx.eval_shape(lambda: moe.Transformer(cfg, nnx.Rngs(0)))
    with pytest.raises(ExportError, match=feature.replace("(", r"\(").replace(")", r"\)")):
        write_hf_checkpoint(model, str(tmp_path / "out"), tokenizer_path, "float32", CARD)
    assert not (tmp_path / "out").exists()
    assert unsupported_features(moe.ModelConfig(**BASE)) == []


def test_tokenizer_without_special_tokens(tmp_path):
    path = str(tmp_path / "tokenizer.json")
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(path)
    with pytest.raises(ExportError, match="<\\|endoftext\\|> is missing"):
        special_token_ids(path)
    with pytest.raises(ExportError, match="not found"):
        special_token_ids(str(tmp_path / "nope.json"))
