"""The device mesh (data, fsdp, expert, tensor) from the config; -1 takes the remaining devices."""

import math

import jax

from moe import sharding
from moe.sharding import MESH_AXES
from plumbing.errors import UserError


def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, ...]:
    sizes = [int(getattr(mesh_cfg, a)) for a in MESH_AXES]
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1:
        raise UserError("at most one mesh axis may be -1 (the remaining devices); set the others explicitly")
    fixed = math.prod(s for s in sizes if s != -1)
    if free:
        if n_devices % fixed:
            raise UserError(f"mesh axes {dict(zip(MESH_AXES, sizes))} do not divide the {n_devices} devices")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes) != n_devices:
        shape = "x".join(map(str, sizes))
        raise UserError(f"mesh {shape} (data x fsdp x expert x tensor) needs {math.prod(sizes)} devices but "
                        f"{n_devices} are available; set --config.mesh.* so their product is {n_devices}")
    return tuple(sizes)


def make_mesh(mesh_cfg) -> jax.sharding.Mesh:
    return sharding.make_mesh(*mesh_shape(mesh_cfg, jax.device_count()))


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]
