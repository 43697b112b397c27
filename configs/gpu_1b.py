"""GPU-sized config: ~1.0B total / ~0.19B active parameters, sequence 2048, bf16 compute (fp32 master params).

    python -m train --config configs/gpu_1b.py --workdir runs/gpu_1b
    # 8 GPUs, experts split 8 ways, batch over the rest (full remat: expert-parallel's no-drop exchange buffers hold
    # mesh.expert x the local rows, which save_moe would keep for every layer):
    python -m train --config configs/gpu_1b.py --workdir runs/gpu_1b --config.mesh.expert=8 --config.mesh.data=1 \\
        --config.execution.dispatch=expert_parallel_dropless --config.execution.remat_policy=full
    # another TFDS text set (prepared as array_record) with its own tokenizer:
    python -m train --config configs/gpu_1b.py --config.data.name=lm1b --config.data.tokenizer=PATH/tokenizer.json \\
        --config.model.vocab_size=32768

Architecture (DeepSeek-V3-like, scaled down): 16 layers (1 dense + 15 MoE), d_model 1024, 16 query heads / 4
kv heads of 64, 64 fine-grained routed experts of width 320 (top-6, routed in 8 groups, the best 4 eligible)
plus 2 shared experts, routed_scaling_factor 2.5, cuDNN flash attention (bf16; it runs as `xla` attention off
NVIDIA GPUs, tested equal to einsum; its GPU equality test is in `python -m benchmarks.gpu_report`). Blocks
are rematerialized keeping the routed experts' residuals (`execution.remat_policy=save_moe`): the backward
pass reruns attention, norms, router and shared experts but not the routed experts' routing, sort or matmuls:
~5% faster than `full` remat, at 8 experts and at 64. At batch 16 x 2048 and 64 experts the step's peak memory
stays under ~46 GiB (~35 with `full`), within one H100. `--config.execution.scan_layers=true` runs the 15 MoE
blocks as one lax.scan (one compiled copy of the block: about half the unrolled step's compile time); off here
as everywhere: it costs step time on CPU, and on a GPU its step time against the unrolled step is unknown.
Global batch 64 x 2048 tokens in 4 micro-batches.
moe.param_counts(...) gives the exact figures (total 1,042M / active 186M with the bundled 8192-token vocabulary).
"""

from configs.base import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=8192, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=4, head_dim=64, d_ff=2816,
                   first_k_dense=1, n_routed_experts=64, n_shared_experts=2, top_k=6, moe_d_ff=320, n_group=8,
                   topk_group=4, routed_scaling_factor=2.5, rope_theta=10000.0)
    c.execution.update(dtype="bfloat16", remat=True, remat_policy="save_moe", attention_impl="cudnn")
    c.data.seq_len = 2048
    c.train.update(steps=20000, batch_size=64, grad_accum=4, lr=1e-3, warmup_steps=1000, schedule="wsd",
                   decay_frac=0.2, weight_decay=0.1)
    c.checkpoint.update(every=1000, keep=3)
    c.log.update(every=20, peak_flops=989e12)  # H100 SXM dense bf16; set yours, or 0 to measure
    c.eval.update(every=1000, rows_per_domain=16, batch_size=32)
    return c
