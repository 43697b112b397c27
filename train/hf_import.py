"""The inverse of train/hf_export.py: a HuggingFace directory (config.json + safetensors) -> our model.

  model = load_hf_checkpoint("out/hf")        # moe.Transformer, params in fp32, routing biases restored

Delegates to moe_import (docs/hf_import.md): our own Glm4MoeForCausalLM exports load exactly as before, and so do
the other families it reproduces (Qwen2/3-MoE, OLMoE, Mixtral, GLM-4.5). Anything that would load into a model
computing something different is refused with HFImportError naming the field.
"""

from moe.model import Transformer
from moe_import import HFImportError, load_model, model_config
from moe_import.common import read_tensors as read_hf_tensors

__all__ = ["HFImportError", "load_hf_checkpoint", "model_config", "read_hf_tensors"]


def load_hf_checkpoint(path_dir: str) -> Transformer:
    """Our Transformer (fp32 params, fp32 compute) from a HF MoE directory (e.g. written by train/hf_export.py)."""
    return load_model(path_dir)
