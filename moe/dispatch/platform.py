"""The one place a device platform decides anything: what each `auto` execution choice means on it.

`Execution.resolved()` (moe/dispatch/execution.py) turns every `auto` field into this table's value for the platform it
runs on and records the platform; the trainer writes the resolved choices into the run's config. Below that
call nothing asks which device it is on: kernels and dispatch take the concrete choice (a direct call that
passes `auto` gets `choice(...)` of the current platform, the same table).

Each entry is the fastest choice where one was benchmarked (see docs/performance.md): on CPU, slab's spill
layouts and scatter-add backward passes; on NVIDIA GPUs (and ROCm, not benchmarked), slab's pure slabs and
gather-only backward passes; elsewhere ragged_dot, XLA's portable op (not benchmarked).
"""

import jax

# field -> platform -> value; "default" for a platform the table does not name.
AUTO = {
    "grouped_matmul": {"cpu": "slab", "cuda": "slab", "rocm": "slab", "default": "ragged_dot"},
    "permute_grad": {"cpu": "scatter", "default": "gather"},
}
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def current() -> str:
    """The default device's platform: cpu, cuda, rocm, tpu (or what JAX calls another backend)."""
    backend = jax.default_backend()
    if backend == "gpu":
        return "cuda" if "cuda" in jax.devices()[0].client.platform_version.lower() else "rocm"
    return backend


def choice(field: str, value: str, platform: str | None = None) -> str:
    """`value` of execution field `field`, with `auto` made concrete for `platform` (default: the current one)."""
    if value != "auto":
        return value
    table = AUTO[field]
    return table.get(platform or current(), table["default"])


def attention_impl(name: str, platform: str | None = None) -> str:
    """cuDNN exists only on NVIDIA GPUs; elsewhere (say, analysing a GPU run on a laptop) `cudnn` runs as `xla`,
    the same function."""
    return "xla" if name == "cudnn" and (platform or current()) != "cuda" else name
