"""Greedy speculative decoding with the MTP draft (moe/decoding/speculative.py, train.generate --speculative mtp): the
output is plain greedy decoding's token for token, with drafts both accepted and rejected, for GQA and MLA caches;
a run trained with MTP logs each depth, decodes speculatively from the command line and exports its MTP module."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe import ModelConfig, Transformer
from moe.decoding.generate import generate
from moe.decoding.speculative import speculative_generate
from tests.model_fixtures import TINY, ragged_execution
from train import export_dir

EX = ragged_execution()  # the equality holds for any execution
MLA = dict(attention="mla", q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_speculative_output_is_greedy_output(attention):
    cfg = ModelConfig(**{**TINY, "mtp_depth": 1, "init_std": 0.1, **(MLA if attention == "mla" else {})})
    model = Transformer(cfg, nnx.Rngs(0))
    # the draft reads the main model's last hidden state: tie it to the main model's own prediction so that some
    # drafts are right (an untrained MTP module is right by chance only)
    module = model.mtp[0]
    module.eh_proj.set_value(jnp.zeros_like(module.eh_proj[...]).at[cfg.d_model:].set(jnp.eye(cfg.d_model)))
    drafts = accepted = 0
    # two prompt lengths (the prompt fills the draft cache's slots [0, P - 1)); seeds 0 and 1 share compiled programs
    for seed, P in ((0, 3), (1, 3), (2, 6)):
        prompt = jnp.asarray(np.random.default_rng(seed).integers(1, TINY["vocab_size"], (1, P)), jnp.int32)
        ref = generate(model, prompt, jax.random.key(0), max_new_tokens=20, temperature=0.0, execution=EX)
        out, d, a = speculative_generate(model, prompt, max_new_tokens=20, execution=EX)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
        drafts, accepted = drafts + int(d), accepted + int(a)
    assert 0 < accepted < drafts  # both branches ran


def test_speculative_decoding_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="model.mtp_depth must be >= 1"):
        speculative_generate(Transformer(ModelConfig(**TINY), nnx.Rngs(0)), jnp.ones((1, 4), jnp.int32),
                             max_new_tokens=2)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        speculative_generate(Transformer(ModelConfig(**{**TINY, "mtp_depth": 1}), nnx.Rngs(0)),
                             jnp.ones((1, 1), jnp.int32), max_new_tokens=2)


@pytest.mark.slow  # trains a tiny MTP run for 4 steps, then decodes and exports it
def test_a_run_trained_with_mtp_end_to_end(tmp_path, capsys):
    from moe.hf import load_hf_moe
    from tests.conftest import tiny_config
    from train import generate as gen
    from train.loop import run

    workdir = tmp_path / "run"
    run(tiny_config(**{"model.mtp_depth": 1, "train.steps": 4, "log.every": 2, "eval.every": 4,
                       "checkpoint.every": 4}), workdir, log=lambda *a: None)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    n_layers = 2  # configs/tiny.py: the MTP block is layer 2
    assert all(np.isfinite(r["mtp/loss_1"]) and f"moe/layer_{n_layers}/maxvio" in r for r in train_rows)
    assert any("val/loss" in r for r in rows) and not any("mtp" in k for r in rows if "val/loss" in r for k in r)
    new = gen.main(["--workdir", str(workdir), "--prompt", "In the beginning", "--max_new_tokens", "12",
                    "--speculative", "mtp"])
    err = capsys.readouterr().err
    assert "speculative (mtp):" in err and "output identical" in err and len(new) <= 12
    out = export_dir.export(workdir, tmp_path / "hf")
    assert load_hf_moe(str(out))[0].cfg.mtp_depth == 1


def test_speculative_flag_refuses_a_model_without_mtp(tiny_run, capsys):
    from train import generate as gen

    with pytest.raises(SystemExit) as e:
        gen.main(["--workdir", str(tiny_run), "--prompt", "In the beginning", "--speculative", "mtp"])
    assert e.value.code == 2 and "multi-token prediction module, and this model has none" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gen.main(["--workdir", str(tiny_run), "--prompt", "x", "--speculative", "eagle"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--speculative: invalid choice: 'eagle'" in err and err.count("\n") == 1
