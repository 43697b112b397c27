"""The model's file formats: HuggingFace checkpoints in and out, exactly, and our own lossless safetensors.

    model, tokenizer = load_hf_moe("path/to/hf_dir")    # moe.Transformer (fp32), tokenizers.Tokenizer or None
    write_hf_checkpoint(model, "out/hf", "tokenizer.json")   # Glm4MoeForCausalLM, or DeepseekV3ForCausalLM (MLA)

Import: one module per family (glm4_moe.py, qwen_moe.py, olmoe.py, mixtral.py, ernie4_5_moe.py, dots1.py,
hunyuan_v1_moe.py, minimax_m2.py, hy_v3.py, llama4.py (llama4_text), gpt_oss.py, qwen3_next.py, and with multi-head latent
attention deepseek.py (deepseek_v2 / deepseek_v3 / kimi_k2, kimi_k25's text model, glm4_moe_lite), deepseek_dsa.py
(deepseek_v32 / glm_moe_dsa up to index_topk keys), mistral4.py, longcat_flash.py: config.json -> ModelConfig), what they share (common.py: the error, config.json's fields and their JSON types,
RoPE), the tensor mapping (weights.py), reading safetensors a tensor at a time (tensors.py, which never leaves the
directory: paths.py), quantized weights dequantized on load (quant.py: DeepSeek's block FP8; gpt-oss's MXFP4) and
the dispatch (load.py). Anything that would not reproduce HF's logits is refused with HFImportError, a ValueError
whose one-line message names the field (docs/hf_import.md). Export: export.py, with write_mla.py for
multi-head latent attention (docs/export.md). Our own format, every variable by its module path: safetensors_io.py.
"""

from moe.hf.common import HFImportError
from moe.hf.load import FAMILIES, load_hf_moe, load_model, load_tokenizer, model_config
from moe.hf.write import ExportError, check_exportable, write_hf_checkpoint

__all__ = ["FAMILIES", "ExportError", "HFImportError", "check_exportable", "load_hf_moe", "load_model",
           "load_tokenizer", "model_config", "write_hf_checkpoint"]
