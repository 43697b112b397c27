"""The checkpoint-save A/B of docs/training.md: 77 small replicated arrays on 8 CPU devices, saved twice by orbax
with its replica-parallel ArrayHandler (`on`) or with it off (`off`, what rundir/checkpoints.py registers in one
process); then restored and compared.

    python docs/cpu/2026-11-27-tenth/checkpoint_save_ab.py on; python docs/cpu/2026-11-27-tenth/checkpoint_save_ab.py off
"""

import os
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

if sys.argv[1] == "off":
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
                                            override=True)
rep = NamedSharding(jax.make_mesh((8,), ("data",)), PartitionSpec())
rng = np.random.default_rng(0)
shapes = [(64, 64), (64,), (8, 64, 32), (8, 32, 64), (8192, 64), (64, 128), (128, 64)] * 11
state = {f"a{i}": jax.device_put(rng.normal(size=s).astype("f4"), rep) for i, s in enumerate(shapes)}
mngr = ocp.CheckpointManager(tempfile.mkdtemp(), options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
for step in (1, 2):
    t = time.time()
    mngr.save(step, args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()
    print(sys.argv[1], "save", step, round(time.time() - t, 3), "s")
abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
restored = mngr.restore(2, args=ocp.args.StandardRestore(abstract))
assert all(np.array_equal(np.asarray(restored[k]), np.asarray(state[k])) for k in state)
