"""Logical axis names -> mesh axes: ONE rules table, and a constraint helper for activations.

Parameters carry logical names as NNX metadata (`out_sharding=("embed", "mlp")`); activations get
`constrain(x, ("batch", "length", "act_embed"))`. Outside `use_mesh(...)` constraints are no-ops, so the
model runs unchanged on one device.
"""

import contextlib
from collections.abc import Sequence

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

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
    ("expert", "expert"),
    ("norm", None),
)

_MESH: list = []  # the active (mesh, rules), innermost last


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules=RULES):
    """Within this context `constrain` places activations on `mesh` by `rules`."""
    _MESH.append((mesh, rules))
    try:
        yield
    finally:
        _MESH.pop()


def active_mesh():
    return _MESH[-1][0] if _MESH else None


def logical_to_spec(names: Sequence[str | None], rules=RULES) -> PartitionSpec:
    return nn.logical_to_mesh_axes(tuple(names), rules)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op without an active mesh."""
    if not _MESH:
        return x
    mesh, rules = _MESH[-1]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules)))


def state_shardings(state, mesh: jax.sharding.Mesh, rules=RULES):
    """NamedShardings for an nnx.State (params, optimizer state, ...) from its logical metadata."""
    logical = nnx.get_partition_spec(state)
    return nn.logical_to_mesh_sharding(logical, mesh, rules)


def make_mesh(data: int, fsdp: int, expert: int, tensor: int, devices=None) -> jax.sharding.Mesh:
    """A (data, fsdp, expert, tensor) mesh with Auto axis types (so sharding constraints apply)."""
    import numpy as np

    devices = jax.devices() if devices is None else devices
    arr = np.asarray(devices).reshape(data, fsdp, expert, tensor)
    auto = (jax.sharding.AxisType.Auto,) * 4
    return jax.sharding.Mesh(arr, MESH_AXES, axis_types=auto)
