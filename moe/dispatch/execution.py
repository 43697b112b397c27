"""How a model runs, apart from what it is: dispatch, kernels, dtype, remat and the device mesh.

`ModelConfig` (moe/config.py) is the architecture a checkpoint must match; `Execution` is chosen by whoever calls
the model (`model(tokens, execution=...)`), so any execution runs any checkpoint and the call site says which
algorithm runs. Nothing here is looked up from global state.

Routed-expert dispatch (moe/dispatch/: experts.py, expert_parallel.py):
  dropless                  sort token copies by expert + grouped matmul (`grouped_matmul`); never drops. On a
                            mesh XLA partitions it like any other op (no hand-written communication).
  expert_parallel_dropless  shard_map over `mesh`: experts live on their `expert` shard, token copies travel with
                            all_to_all in buffers that cannot overflow (mesh.expert x the local copies): the same
                            result as dropless.
  expert_parallel           the same exchange with capacity_factor-sized buffers: copies past the capacity are
                            dropped, the lowest-priority first (later top-k choices before earlier ones).
  capacity                  GShard one-hot einsums, capacity_factor * L * K / E slots per expert and sequence.
  reference                 the loop over experts (tests).
The expert-parallel modes need the batch's tokens divisible by data * fsdp * expert and raise otherwise
(decoding one token at a time therefore uses `for_decoding()`).

capacity and expert_parallel drop copies, and which copy is dropped depends on the other tokens of its group
(the whole sequence, or all rows on the device for expert_parallel): an earlier position's output can depend on
later tokens, so a causal model trained that way is not strictly causal. The dropless modes have no such leak.
"""

import dataclasses

import jax
from jax.sharding import NamedSharding

from moe.dispatch import platform
from moe.dispatch.expert_parallel import token_shards
from moe.sharding import RULES, logical_to_spec
from plumbing.errors import ConfigError
from plumbing.fields import check_fields, field, one_of, positive

DISPATCH_MODES = ("dropless", "expert_parallel_dropless", "expert_parallel", "capacity", "reference")
DROPPING_DISPATCH = ("expert_parallel", "capacity")
EXPERT_PARALLEL = ("expert_parallel_dropless", "expert_parallel")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("blockwise", "einsum", "xla", "cudnn")
GROUPED_MATMULS = ("auto", "ragged_dot", "blocked", "slab", "tokamax")
# What a rematerialized block keeps for its backward pass (moe/model.py, `remat_policy`):
#   full      nothing but its input: the backward pass reruns the whole block
#   save_moe  the routed experts' residuals too (the sorts, the gate/up pre-activations, expert_parallel's
#             exchanged rows; moe/dispatch/experts.py, `saved`; dropless needs no output rows, its gates scale the experts'
#             products before the down projection): the backward pass reruns attention, the
#             norms, the router and the shared experts, but no routed-expert matmul, sort or all_to_all of rows.
#             expert_parallel_dropless keeps its exchange buffers, mesh.expert x the local rows (no-drop padding):
#             prefer full there when memory is short.
REMAT_POLICIES = ("full", "save_moe")
# How the backward pass of the dropless and expert-parallel dispatches moves the permuted rows (the token copies into
# expert order and back; moe/dispatch/experts.py, `permute_for`): scatter (autodiff of the row gathers: scatter-adds), gather
# (custom VJPs that gather by the inverse permutation), auto (moe/dispatch/platform.py's choice for the platform). The same
# numbers up to the order of the top-k copies' sum.
PERMUTE_GRADS = ("auto", "scatter", "gather")


@dataclasses.dataclass(frozen=True)
class Execution:
    dispatch: str = field("dropless", one_of(*DISPATCH_MODES), doc="the routed-expert algorithm (module docstring)")
    capacity_factor: float = field(1.25, positive, doc="capacity / expert_parallel: slots per expert (1.0 = a "
                                                        "perfectly even load)")
    grouped_matmul: str = field("auto", one_of(*GROUPED_MATMULS),
                                doc="the grouped matmul of the dropless and expert-parallel modes (moe/dispatch/kernels/): "
                                    "ragged_dot, blocked, slab, tokamax (optional package), or auto (platform.py's choice)")
    permute_grad: str = field("auto", one_of(*PERMUTE_GRADS), doc="dropless / expert_parallel: how the backward "
                                                                  "pass moves permuted rows (PERMUTE_GRADS)")
    # einsum: explicit einsums + fp32 softmax (the reference; used for attention maps and, with a KV cache, by GQA;
    # MLA decodes in its absorbed form unless einsum is asked for, which runs the naive reference).
    # blockwise: the same einsums a block of queries at a time, each block against only the keys a causal mask
    # can show it (~37% less work at 4 blocks; other masks run as einsum). xla / cudnn:
    # jax.nn.dot_product_attention(implementation=...); cudnn is fused flash attention on NVIDIA GPUs (bf16/fp16,
    # head_dim a multiple of 8 and <= 256).
    attention_impl: str = field("blockwise", one_of(*ATTENTION_IMPLS),
                                doc="blockwise | einsum (the reference) | xla | cudnn (fused flash attention on "
                                    "NVIDIA GPUs, bf16/fp16)")
    dtype: str = field("float32", one_of(*DTYPES), doc="activations and matmuls; params stay fp32, router and softmax "
                                                       "math run in fp32")
    remat: bool = field(False, doc="recompute each block in the backward pass (activation memory O(1) blocks, not "
                                   "O(depth))")
    remat_policy: str = field("full", one_of(*REMAT_POLICIES), doc="what a rematerialized block keeps "
                                                                   "(REMAT_POLICIES)")
    # The parameters stay one module per layer; the encoder-decoder study model (experiments/encdec/model.py) runs
    # unrolled.
    scan_layers: bool = field(False, doc="consecutive blocks of one structure as one lax.scan (one compiled copy of "
                                         "the MoE block; the same function up to rounding)")
    # The train step computes each chunk's gradient in its forward pass (moe/lm_loss.py, weighted_cross_entropy);
    # 8 runs the default train step fastest on CPU. With the batch sharded, each chunk all-reduces the head's gradient.
    loss_chunks: int = field(8, positive, doc="the loss's LM head + cross-entropy run over the sequence in this many "
                                              "chunks (the largest divisor of L not above it)")
    # Activations are constrained to this mesh by `rules` (logical axis -> mesh axis); None: no constraints.
    mesh: jax.sharding.Mesh | None = None
    rules: tuple = RULES
    # The platform (moe/dispatch/platform.py) the `auto` choices above were made for; "" until `resolved()` makes them.
    platform: str = ""

    def __post_init__(self):
        validate(self)

    def replace(self, **changes) -> "Execution":
        return dataclasses.replace(self, **changes)

    def resolved(self, platform_name: str | None = None) -> "Execution":
        """Every `auto` choice made concrete for `platform_name` (default: the one already recorded, else the
        current device's), cuDNN attention off NVIDIA GPUs run as `xla`, and the platform recorded. The model
        resolves its execution on entry; the trainer logs the resolved choices into the run's config."""
        p = platform_name or self.platform or platform.current()
        return self.replace(platform=p, grouped_matmul=platform.choice("grouped_matmul", self.grouped_matmul, p),
                            permute_grad=platform.choice("permute_grad", self.permute_grad, p),
                            attention_impl=platform.attention_impl(self.attention_impl, p))

    def for_decoding(self) -> "Execution":
        """Dropless: one-token steps need not divide over the mesh, and generation must not depend on the rest
        of the batch (a dropping dispatch would make it). The reference stays the reference."""
        return self.replace(dispatch="dropless" if self.dispatch != "reference" else "reference")

    def constrain(self, x: jax.Array, names) -> jax.Array:
        """Sharding constraint by logical axis names on this execution's mesh; a no-op without one."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, logical_to_spec(names, self.rules)))

    @property
    def expert_shards(self) -> int:
        return self.mesh.shape["expert"] if self.mesh is not None else 1

    @property
    def token_shards(self) -> int:
        """Devices the tokens are split over in expert parallelism (data * fsdp * expert)."""
        return 1 if self.mesh is None else token_shards(self.mesh)


def execution_fields() -> dict:
    """The user-settable fields and their defaults (configs/base.py builds its `execution` section from this)."""
    return {f.name: f.default for f in dataclasses.fields(Execution) if f.name not in ("mesh", "rules", "platform")}


def validate(ex: Execution) -> None:
    check_fields(ex, "execution")
    if ex.attention_impl == "cudnn" and ex.dtype == "float32":
        raise ConfigError("execution.attention_impl: cudnn attention runs in bfloat16 or float16; set "
                          "execution.dtype=bfloat16 or use attention_impl=xla")
    if ex.dispatch in EXPERT_PARALLEL and ex.mesh is not None and "expert" not in ex.mesh.shape:
        raise ConfigError(f"execution.dispatch: {ex.dispatch} needs a mesh with an 'expert' axis, got axes "
                          f"{tuple(ex.mesh.shape)}")


def check_model(ex: Execution, cfg) -> None:
    """What this execution needs of the architecture; ConfigError naming the field if it cannot run it."""
    width = max(cfg.qk_head_dim, cfg.value_head_dim)  # MLA pads keys and values to one width for the kernel
    if ex.attention_impl == "cudnn" and (width % 8 or width > 256):
        raise ConfigError(f"execution.attention_impl: cudnn attention needs a head width (model.head_dim, or MLA's "
                          f"qk_nope_head_dim + qk_rope_head_dim and v_head_dim) a multiple of 8 and <= 256, got "
                          f"{width}")
    if ex.dispatch in EXPERT_PARALLEL and cfg.n_routed_experts % ex.expert_shards:
        raise ConfigError(f"execution.dispatch: {ex.dispatch} splits model.n_routed_experts "
                          f"({cfg.n_routed_experts}) over mesh.expert ({ex.expert_shards}); make it divisible")


def check_tokens(ex: Execution, n_tokens: int, what: str = "the batch") -> None:
    """Expert parallelism splits the tokens over data * fsdp * expert devices: they must divide."""
    if ex.dispatch in EXPERT_PARALLEL and n_tokens % ex.token_shards:
        raise ConfigError(f"execution.dispatch: {ex.dispatch} splits the {n_tokens} tokens of {what} over "
                          f"data*fsdp*expert = {ex.token_shards} devices; use a batch whose tokens divide, or "
                          f"dispatch=dropless")

