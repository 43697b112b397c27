"""Decoder-only Mixture-of-Experts Transformer (DeepSeek-V3-style routing) in Flax NNX.

Read in this order: config.py (what the model is), nn.py (parameters, RMSNorm), attention.py (masks, RoPE, the
kernels, grouped-query attention; mla.py and gdn.py, Gated DeltaNet, beside it), ffn.py (the dense SwiGLU and the MoE layer), router.py (every
router, one table), dispatch/ (how the routed experts run: execution choices, expert paths, expert parallelism,
kernels), model.py (the stack; lm_loss.py and mtp.py beside it). decoding/ generates with a KV cache; hf/ reads and
writes HuggingFace checkpoints; accounting.py counts parameters and FLOPs; sharding.py maps logical axes to a mesh.

The names below load their module on first use, so `from moe.config import ModelConfig` (what a command needs to
check its flags) does not build the whole model library.
"""

import importlib

_EXPORTS = {
    "ConfigError": "plumbing.errors",
    "Execution": "moe.dispatch.execution",
    "ModelConfig": "moe.config",
    "RoutingBias": "moe.ffn",
    "Transformer": "moe.model",
    "param_counts": "moe.accounting",
    "routing_biases": "moe.model",
    "set_routing_biases": "moe.model",
    "train_flops_per_token": "moe.accounting",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moe' has no attribute {name!r}")
