"""How much host memory an analysis of a HuggingFace checkpoint needs, in memory or layer-streamed, and how much
this process may use: what `analysis.routing --hf` decides its mode by.

    budget = memory_budget()                    # bytes: /proc/meminfo MemAvailable, within the cgroup's limit
    need = needs(stream, n_rows=..., seq_len=...)    # {"memory": bytes, "stream": bytes, ...}

In memory (moe.hf.load_hf_moe): the import peaks near 1.2x the fp32 model's bytes (docs/hf_import.md, "Host
memory"), MTP layers included. Streamed (moe/hf/stream.py): the largest block's weights as held (fp32; held as
stored, their fp32 copies inside the computation too), the expert weights the CPU kernel gathers (KERNEL_GATHER),
the hidden states of every analysed row, and one batch's activations. Both add the routing tables of the analysis
(analysis.routing.stats: the L x V x E int32 token-by-expert counts dominate) and a fixed overhead (Python, JAX,
XLA's CPU client: OVERHEAD, measured). These are estimates for choosing a mode; benchmarks/streamed_analysis.py
measures the peak.
"""

import math
import os

OVERHEAD = 1.0e9  # resident memory of a process that has imported jax and moe and compiled a block (measured ~0.8 GB)
IMPORT_PEAK = 1.2  # the in-memory import's peak over the fp32 model's bytes (docs/hf_import.md)
# XLA:CPU's grouped matmul (moe/dispatch/kernels/slab.py) runs the rows past each expert's slab in blocks of about a
# quarter of the mean rows per expert, each block with its expert's weights gathered: with half the rows spilled,
# about 2E blocks, twice the routed experts' fp32 bytes (measured: +4.1 GB for DeepSeek-V2-Lite's 2.2 GB of fp32
# expert weights at 512 and 2,048 tokens a batch; benchmarks/streamed_analysis.py).
KERNEL_GATHER = 2.0
LOSS_CHUNKS = 8  # moe.dispatch.execution.Execution.loss_chunks' default: the streamed head's logits per chunk


def memory_budget() -> int:
    """Bytes this process may still use: MemAvailable of /proc/meminfo, or less when the cgroup (v2 memory.max, v1
    memory.limit_in_bytes) allows less beyond what it already holds; 0 when neither can be read."""
    avail = _meminfo("MemAvailable")
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, used = _read_int(limit), _read_int(usage)
        if lim is not None and used is not None and lim < 2**60:  # "max" and v1's huge default: no limit
            avail = min(avail, max(lim - used, 0)) if avail else max(lim - used, 0)
    return avail


def _meminfo(field: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _read_int(path: str):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def routing_table_bytes(cfg) -> int:
    """The routing analysis's accumulators: L x V x E int32 token counts, plus the small per-domain tables."""
    return 4 * cfg.n_moe_layers * cfg.vocab_size * cfg.n_candidates


def activation_bytes(cfg, n_rows: int, seq_len: int, batch_size: int) -> int:
    """Streamed: every row's hidden state (fp32) before and after the block that runs, plus one batch's largest
    activations (the attention scores of every head, fp32, the routed copies' hidden units, the logits of one of
    the LOSS_CHUNKS sequence chunks the head runs in: moe.lm_loss.cross_entropy)."""
    hidden = 2 * 4 * n_rows * seq_len * cfg.d_model
    attn = 4 * batch_size * cfg.n_heads * seq_len * seq_len * 2
    ffn = 4 * batch_size * seq_len * max(cfg.d_ff, cfg.top_k * cfg.moe_d_ff) * 3
    logits = 4 * batch_size * -(-seq_len // LOSS_CHUNKS) * cfg.vocab_size * 2
    return hidden + max(attn, ffn, logits)


def needs(stream, n_rows: int, seq_len: int, batch_size: int) -> dict:
    """Estimated peak bytes of the two modes for a moe.hf.stream.LayerStream over n_rows rows of seq_len."""
    cfg, files = stream.cfg, stream.files
    fp32_model = sum(4 * math.prod(s) for s in files.shapes.values())  # MTP layers too: the import holds them
    blocks = [f"blocks.{i}" for i in range(cfg.n_layers)]
    # a block as held, the fp32 copies the computation makes of BF16 / F16 weights, the kernel's gathered experts
    layer = max(stream.held_bytes(g) + (4 * _values(stream, g) if stream.held_bytes(g) < 4 * _values(stream, g) else 0)
                + int(KERNEL_GATHER * 4 * _values(stream, g, experts_only=True)) for g in blocks)
    ends = max(stream.held_bytes(ends=("embed",)), stream.held_bytes(ends=stream.head_names()))
    tables, acts = routing_table_bytes(cfg), activation_bytes(cfg, n_rows, seq_len, batch_size)
    return {"memory": int(IMPORT_PEAK * fp32_model) + acts + tables + OVERHEAD,
            "stream": max(layer, ends) + acts + tables + OVERHEAD, "fp32_model": fp32_model,
            "largest_layer": max(stream.held_bytes(g) for g in blocks), "tables": tables, "activations": acts}


def _values(stream, group: str, experts_only: bool = False) -> int:
    """The number of values in the block's weights (or in its routed experts' only)."""
    return sum(math.prod(stream.files.shapes[n]) for n in stream._tensors(group)
               if not experts_only or (".experts." in n and "shared" not in n))


def gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB"


def choose_mode(stream, memory_gb: float | None, n_rows: int, seq_len: int, batch_size: int) -> tuple[str, str]:
    """("memory" | "stream", the one-line reason): in memory when its estimate fits the budget (--memory_gb, else
    memory_budget()), else streamed. Raises ValueError when neither fits."""
    budget = int(memory_gb * 1e9) if memory_gb is not None else memory_budget()
    est = needs(stream, n_rows, seq_len, batch_size)
    where = f"--memory_gb {memory_gb:g}" if memory_gb is not None else "available memory"
    if not budget or est["memory"] <= budget:
        return "memory", (f"in memory: the fp32 model needs about {gb(est['memory'])}, {where} is "
                          f"{gb(budget) if budget else 'unknown'}")
    if est["stream"] > budget:
        raise ValueError(f"the model does not fit {where} ({gb(budget)}) even streamed one layer at a time (about "
                         f"{gb(est['stream'])}: largest layer {gb(est['largest_layer'])}, routing tables "
                         f"{gb(est['tables'])}, activations {gb(est['activations'])}); fewer --max_tokens, or a "
                         "larger machine")
    return "stream", (f"streamed one layer at a time: in memory would need about {gb(est['memory'])}, {where} is "
                      f"{gb(budget)}; streamed about {gb(est['stream'])}")


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
