"""The model's file formats: HuggingFace checkpoints in and out, exactly, and our own lossless safetensors.

    model, tokenizer = load_hf_moe("path/to/hf_dir")    # moe.Transformer (fp32), tokenizers.Tokenizer or None
    write_hf_checkpoint(model, "out/hf", "tokenizer.json")   # Glm4MoeForCausalLM, or DeepseekV3ForCausalLM (MLA)

Import: one module per family (glm4_moe.py, qwen_moe.py, olmoe.py, mixtral.py, and deepseek.py for the multi-head
latent attention families deepseek_v2 / deepseek_v3 / glm4_moe_lite: config.json -> ModelConfig), the
tensor mapping they share (weights.py), reading (common.py, which never leaves the directory: paths.py) and the
dispatch (load.py). Anything that would not reproduce HF's logits is refused with HFImportError, a ValueError
whose one-line message names the field (docs/hf_import.md). Export: export.py, with write_mla.py for
multi-head latent attention (docs/export.md). Our own format, every variable by its module path: safetensors_io.py.
"""

from moe.hf.common import HFImportError
from moe.hf.load import FAMILIES, load_hf_moe, load_model, load_tokenizer, model_config
from moe.hf.write import ExportError, check_exportable, write_hf_checkpoint

__all__ = ["FAMILIES", "ExportError", "HFImportError", "check_exportable", "load_hf_moe", "load_model",
           "load_tokenizer", "model_config", "write_hf_checkpoint"]
