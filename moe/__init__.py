"""Decoder-only Mixture-of-Experts Transformer (DeepSeek-V3-style routing) in Flax NNX."""

from moe.accounting import param_counts, train_flops_per_token
from moe.config import ConfigError, ModelConfig
from moe.execution import Execution
from moe.model import Transformer, routing_biases, set_routing_biases
from moe.moe_layer import RoutingBias

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
