"""Logical axis names -> mesh axes: ONE rules table, and the one mesh builder.

Parameters carry logical names as NNX metadata (`out_sharding=("embed", "mlp")`); activations get
`execution.constrain(x, ("batch", "length", "act_embed"))` (moe/dispatch/execution.py), a no-op when the execution has no
mesh, so the model runs unchanged on one device.
"""

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import PartitionSpec

from plumbing.errors import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Parameters are sharded ZeRO-3 style over fsdp (along `embed`), Megatron style over tensor (mlp / heads /
# vocab), and expert weights along `expert`. The activation batch is split over data and fsdp.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    # MLA (moe/mla.py): every tensor rank computes the whole latent (its down projections' output axis is
    # replicated); the up projections read it along `latent_in`, sharded over fsdp as `embed` is.
    ("latent", None),
    ("latent_in", "fsdp"),
    ("expert", "expert"),
    ("norm", None),
)

def logical_to_spec(names: Sequence[str | None], rules=RULES) -> PartitionSpec:
    return nn.logical_to_mesh_axes(tuple(names), rules)


# The model config field behind each logical axis a parameter is split along: what a user resizes to make it divide.
AXIS_FIELDS = {"expert": "model.n_routed_experts", "heads": "model.n_heads", "kv_heads": "model.n_kv_heads",
               "vocab": "model.vocab_size", "embed": "model.d_model", "mlp": "model.d_ff / model.moe_d_ff",
               "latent_in": "model.q_lora_rank / model.kv_lora_rank"}


def state_shardings(state, mesh: jax.sharding.Mesh, rules=RULES):
    """NamedShardings for an nnx.State (params, optimizer state, ...) from its logical metadata; ConfigError naming
    the parameter, the config field and the mesh axis when a dimension does not split evenly."""
    logical = nnx.get_partition_spec(state)
    shardings = nn.logical_to_mesh_sharding(logical, mesh, rules)
    check_divisible(state, logical, shardings)
    return shardings


def check_divisible(state, logical, shardings) -> None:
    """Every sharded dimension must split evenly over its mesh axes (JAX's own error is a multi-line dump)."""
    flat = jax.tree_util.tree_leaves_with_path(state)
    for (path, leaf), names, sharding in zip(flat, jax.tree.leaves(logical, is_leaf=_is_spec),
                                             jax.tree.leaves(shardings), strict=True):
        for dim, axes, name in zip(getattr(leaf, "shape", ()), sharding.spec, tuple(names) + (None,) * 8):
            axes = (axes,) if isinstance(axes, str) else (axes or ())
            n = math.prod(sharding.mesh.shape[a] for a in axes)
            if dim % n:
                field = AXIS_FIELDS.get(name, "the model size")
                raise ConfigError(f"parameter {jax.tree_util.keystr(path)} has a dimension of {dim} (logical axis "
                                  f"{name!r}) that does not split over mesh axes {'x'.join(axes)} ({n} devices); "
                                  f"make {field} divisible by mesh.{' x mesh.'.join(axes)}, or change the mesh")


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def make_mesh(data: int, fsdp: int, expert: int, tensor: int, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, expert, tensor) mesh with Auto axis types (so sharding constraints apply).

    jax.make_mesh orders the devices for the physical topology (ICI / NVLink first), also across hosts; tests
    and training build their meshes here, so tests see the production device order."""
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh((data, fsdp, expert, tensor), MESH_AXES, axis_types=auto, devices=devices)
