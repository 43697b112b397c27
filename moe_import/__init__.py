"""Import HuggingFace MoE checkpoints (GLM-4.5, Qwen2/3-MoE, OLMoE, Mixtral) into our model, exactly.

    model, tokenizer = load_hf_moe("path/to/hf_dir")    # moe.Transformer (fp32), tokenizers.Tokenizer or None

One module per family (glm4_moe.py, qwen_moe.py, olmoe.py, mixtral.py: config.json -> ModelConfig), the tensor
mapping they share (weights.py), and the dispatch (load.py). Anything that would not reproduce HF's logits is
refused with HFImportError, a ValueError whose one-line message names the field. See docs/hf_import.md.
"""

from moe_import.common import HFImportError
from moe_import.load import FAMILIES, load_hf_moe, load_model, load_tokenizer, model_config

__all__ = ["FAMILIES", "HFImportError", "load_hf_moe", "load_model", "load_tokenizer", "model_config"]
