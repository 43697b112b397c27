"""Logical axis names -> mesh axes: ONE rules table, and the one mesh builder.

Parameters carry logical names as NNX metadata (`out_sharding=("embed", "mlp")`); activations get
`execution.constrain(x, ("batch", "length", "act_embed"))` (moe/dispatch/execution.py), a no-op when the execution has no
mesh, so the model runs unchanged on one device.
"""

from collections.abc import Sequence

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import PartitionSpec

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


def state_shardings(state, mesh: jax.sharding.Mesh, rules=RULES):
    """NamedShardings for an nnx.State (params, optimizer state, ...) from its logical metadata."""
    logical = nnx.get_partition_spec(state)
    return nn.logical_to_mesh_sharding(logical, mesh, rules)


def make_mesh(data: int, fsdp: int, expert: int, tensor: int, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, expert, tensor) mesh with Auto axis types (so sharding constraints apply).

    jax.make_mesh orders the devices for the physical topology (ICI / NVLink first), also across hosts; tests
    and training build their meshes here, so tests see the production device order."""
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh((data, fsdp, expert, tensor), MESH_AXES, axis_types=auto, devices=devices)
