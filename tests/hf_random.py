"""A tiny transformers model with every weight random, shared by the HF parity tests (import and export)."""

import torch
import transformers


def random_hf(config, seed=0):
    """The model of `config` in fp32, eval mode, with norm scales near 1, every other weight N(0, 0.3) and routing
    biases (e_score_correction_bias) non-zero, so that they change which experts win."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
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
