"""A tiny transformers model with every weight random, and transformers' side of a parity check (logits, chosen
experts, greedy tokens), shared by the HF parity tests (import and export)."""

import json
import math
import shutil

import ml_dtypes
import numpy as np
import torch
import transformers
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from analysis.routing import cli as routing
from tests.model_fixtures import ragged_execution

# The parity checks' subject is the import (weights, config, attention and router math), not the routed experts'
# kernel: our side runs ragged_dot, which compiles in a fraction of CPU's default (slab). tests/test_grouped_kernels.py
# holds the kernels equal; `analysis.routing --hf` runs each family on the default.
EX = ragged_execution()


def random_hf(config, seed=0, cls=None):
    """The model of `config` (class `cls`, default the AutoModelForCausalLM one) in fp32, eval mode, with norm
    scales near 1, every other weight N(0, 0.3) and routing biases (e_score_correction_bias) non-zero, so that they
    change which experts win."""
    torch.manual_seed(seed)
    if cls is None:
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:
        hf = cls._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname or "layernorm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
        for bname, b in hf.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.uniform_(-0.5, 0.5)  # the size of the score spread
    return hf


def hf_forward(hf, tokens, routers=("mlp.gate", "block_sparse_moe.gate"), chosen=lambda out: out[2]):
    """(logits [B, L, V] fp32, per MoE layer the chosen expert ids [B*L, K]) from transformers; the ids are read by
    a forward hook on each router module (named ending in one of `routers`), `chosen(its output)`: most families'
    routers return them third."""
    ids, hooks = [], []
    for name, mod in hf.named_modules():
        if name.endswith(tuple(routers)):
            hooks.append(mod.register_forward_hook(lambda _m, _i, out: ids.append(np.asarray(chosen(out)))))
    with torch.no_grad():
        logits = hf(torch.tensor(tokens)).logits.float().numpy()
    for h in hooks:
        h.remove()
    return logits, ids


@nnx.jit
def ours_forward(model, tokens):
    """Our (logits, per MoE layer the chosen expert ids [B, L, K]), one compiled program per model shape."""
    logits, aux = model(tokens, return_routing=True, execution=EX)
    return logits, [r["expert_ids"] for r in aux["routing"]]


def hf_generate(hf, prompt, n_new):
    """transformers' greedy generate (its own KV cache): the n_new tokens after `prompt` [B, P]."""
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt), attention_mask=torch.ones_like(torch.tensor(prompt)),
                          do_sample=False, max_new_tokens=n_new)
    return out[:, prompt.shape[1]:].numpy()


def byte_bpe_tokenizer():
    """A byte-level BPE of < 300 tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. def f(x): return x + 1"] * 20, trainer)
    return tok


def routing_on_hf(path, tmp_path):
    """`analysis.routing --hf` on a copy of the checkpoint at `path` (tmp_path/hf, with `byte_bpe_tokenizer`) over
    ten lines of prose: (the analysis, tmp_path/out/routing.json read back)."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(path, hf_dir)
    byte_bpe_tokenizer().save(str(hf_dir / "tokenizer.json"))
    (tmp_path / "prose.txt").write_text("The quick brown fox jumps over the lazy dog, again and again.\n" * 10)
    a, _ = routing.run(routing.parse_args([
        "--hf", str(hf_dir), "--text", str(tmp_path / "prose.txt"), "--out", str(tmp_path / "out"), "--seq_len", "16",
        "--batch_size", "4", "--no_progress"]), log=lambda *_: None)
    return a, json.loads((tmp_path / "out" / "routing.json").read_text())


def same_experts(ours, theirs) -> list[float]:
    """Per MoE layer, the share of tokens whose chosen expert SETS agree (ours [B, L, K] per layer, HF's [B*L, K])."""
    return [float(np.mean(np.sort(np.asarray(a).reshape(-1, a.shape[-1]), -1) == np.sort(b, -1)))
            for a, b in zip(ours, theirs)]


# DeepSeek's block FP8, as DeepSeek-V3 / Kimi-K2 ship it (docs/hf_import.md, moe/hf/quant.py).

def deepseek_rule(q, s, block):
    """DeepSeek's inference/kernel.py weight_dequant, written as an index: w[i, j] = q[i, j] * s[i // bm, j // bn]."""
    i = np.arange(q.shape[0])[:, None] // block[0]
    j = np.arange(q.shape[1])[None, :] // block[1]
    return q.astype(np.float32) * s[i, j]


def quantize(w, block, power_of_two=False):
    """DeepSeek's weight_quant per tile: s = amax / 448 (ue8m0: the next power of two up), q = e4m3(w / s)."""
    rows, cols = w.shape
    s = np.ones((math.ceil(rows / block[0]), math.ceil(cols / block[1])), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for a in range(s.shape[0]):
        for b in range(s.shape[1]):
            tile = w[a * block[0]:(a + 1) * block[0], b * block[1]:(b + 1) * block[1]]
            amax = float(np.abs(tile).max()) or 1.0
            s[a, b] = 2.0 ** math.ceil(math.log2(amax / 448)) if power_of_two else amax / 448
            # ml_dtypes turns values past 448 into NaN where torch saturates: clip first
            q[a * block[0]:(a + 1) * block[0], b * block[1]:(b + 1) * block[1]] = \
                np.clip(tile / s[a, b], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, s


def quantized_linear(name, arr) -> bool:
    """What DeepSeek-V3 stores as FP8: every attention / MLP / expert Linear weight (not the router, norms,
    embedding or head)."""
    return name.endswith("_proj.weight") and arr.ndim == 2


def write_fp8(path, config: dict, sd: dict, block, power_of_two=lambda name: False, rename=lambda name: name,
              extra=None):
    """An FP8 checkpoint of `sd` as DeepSeek ships one (F8_E4M3 + F32 scale_inv, BF16 elsewhere, the router F32),
    each tensor stored as rename(name), beside the `extra` tensors as given; returns the fp32 weights it stands for
    (dequantized by deepseek_rule, the rest as stored), by their names in `sd`."""
    stored, meant = dict(extra or {}), {}
    for k, v in sd.items():
        if quantized_linear(k, v):
            q, s = quantize(v, block, power_of_two(k))
            stored[rename(k)], stored[rename(k) + "_scale_inv"], meant[k] = q, s, deepseek_rule(q, s, block)
        else:
            keep32 = "mlp.gate." in k  # DeepSeek-V3's router weight and bias stay fp32
            stored[rename(k)] = v if keep32 else v.astype(ml_dtypes.bfloat16)
            meant[k] = stored[rename(k)].astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return meant
