"""Decoder-only Mixture-of-Experts Transformer (DeepSeek-V3-style routing) in Flax NNX.

Read in this order: config.py (what the model is), nn.py (parameters, RMSNorm), attention.py (masks, RoPE, the
kernels, grouped-query attention; mla.py beside it), ffn.py (the dense SwiGLU and the MoE layer), router.py (every
router, one table), dispatch/ (how the routed experts run: execution choices, expert paths, expert parallelism,
kernels), model.py (the stack; lm_loss.py and mtp.py beside it). decoding/ generates with a KV cache; hf/ reads and
writes HuggingFace checkpoints; accounting.py counts parameters and FLOPs; sharding.py maps logical axes to a mesh.
"""

from moe.accounting import param_counts, train_flops_per_token
from moe.config import ConfigError, ModelConfig
from moe.dispatch.execution import Execution
from moe.ffn import RoutingBias
from moe.model import Transformer, routing_biases, set_routing_biases

__all__ = [
    "ConfigError",
    "Execution",
    "ModelConfig",
    "RoutingBias",
    "Transformer",
    "param_counts",
    "routing_biases",
    "set_routing_biases",
    "train_flops_per_token",
]
