"""How rundir.checkpoints writes replicated arrays: whole, in one process (no per-slice programs), and the files
restore exactly."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rundir import checkpoints


@pytest.fixture
def compiles():
    """Every program the process obtains: an XLA compilation or a hit in the suite's persistent cache (whose use
    JAX settles once per process, so it cannot be switched off here)."""
    events = []
    on_duration = lambda event, secs, **kw: (
        events.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    on_event = lambda event, **kw: events.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    yield events
    jax.monitoring.unregister_event_duration_listener(on_duration)
    jax.monitoring.unregister_event_listener(on_event)


def _save_replicated(mngr, shape):
    """A replicated array over all 8 devices (its first axis divides 8, so orbax could split it among them)."""
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    arr = jax.device_put(value, NamedSharding(mesh, PartitionSpec()))
    jax.block_until_ready(arr)
    mngr.save(1, args=ocp.args.StandardSave({"w": arr}))
    mngr.wait_until_finished()
    return mngr, arr, value


def test_one_process_writes_replicated_arrays_whole_and_they_restore(tmp_path, compiles):
    assert jax.process_count() == 1 and len(jax.devices()) == 8
    # One manager per directory, as in training: a second one's background clean-up of tmp dirs would race the
    # first one's save.
    mngr, arr, value = _save_replicated(checkpoints.manager(tmp_path / "ours", async_save=False), (8 * 7, 3))
    assert compiles == []  # no slice program per array shape
    abstract = {"w": jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=arr.sharding)}
    restored = mngr.restore(1, args=ocp.args.StandardRestore(abstract))["w"]
    np.testing.assert_array_equal(np.asarray(restored), value)

    # The control: orbax's replica-parallel handler (its default unless JAX_PLATFORMS names a GPU) splits the same
    # kind of array among the replicas: a compiled slice (in-memory caches cleared, so a rerun compiles it again).
    jax.clear_caches()
    default = ocp.type_handlers.ArrayHandler(use_replica_parallel=True)
    previous = ocp.type_handlers.get_type_handler(jax.Array)
    with checkpoints.quiet_orbax():  # orbax warns of every override
        ocp.type_handlers.register_type_handler(jax.Array, default, override=True)
    try:
        plain = ocp.CheckpointManager(tmp_path / "orbax_default",
                                      options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
        _save_replicated(plain, (8 * 9, 3))
    finally:
        with checkpoints.quiet_orbax():
            ocp.type_handlers.register_type_handler(jax.Array, previous, override=True)
    assert compiles, "orbax's replica-parallel save compiled nothing: the test no longer sees what it guards"
