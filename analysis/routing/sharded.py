"""The routing analysis on a device mesh: the model imported straight into its shards (moe.hf.load_hf_moe with a
mesh), the rows routed by one jitted forward that runs with the training mesh's activation shardings, and the
routing gathered to every process (replicated outputs) and counted as `collect.analyse` counts it.

    python -m analysis.routing --hf DIR --out OUT --mesh.expert=8                     # one 8-GPU host
    # several hosts: the same command on each, with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
    # (or SLURM) set, as for training (docs/scaling.md); every process routes the same rows, process 0 writes.

Rows are split over (data, fsdp) when the batch size divides, else replicated; the weights as training shards them
(moe/sharding.py). The routing equals the single-device analysis up to the summation order of partitioned
contractions (tests/test_routing_streamed.py).
"""

import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from analysis.routing import accumulate
from moe.dispatch.execution import Execution


def make_mesh(mesh_cfg):
    """The (data, fsdp, expert, tensor) mesh of a rundir.run_config.MeshConfig over every device of every process
    (train/mesh.py: -1 takes the remaining devices; UserError when the product does not match). Several processes
    (SLURM, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) join first, as training's do."""
    from train.loop import maybe_init_distributed
    from train.mesh import make_mesh as make

    maybe_init_distributed()
    return make(mesh_cfg)


def analyse(src, mesh, split, max_tokens, tokens, n_samples=2, n_frequent=20, progress=True):
    """collect.Analysis of analysis.hf_source's HFSource whose model was imported onto `mesh`."""
    from tqdm import tqdm

    run = src.run
    batches, domain_names = accumulate.rows(run, split, max_tokens, src.cache, n_samples)
    B = run.config.eval.batch_size
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")) if B % shards == 0 else PartitionSpec())
    replicated = NamedSharding(mesh, PartitionSpec())
    ex = Execution(mesh=mesh)
    graphdef, state = nnx.split(run.model)

    @jax.jit
    def route(state, tokens_BxL, positions_BxL, segment_ids_BxL):
        model = nnx.merge(graphdef, state)
        _, aux = model.inspect(tokens_BxL, execution=ex, positions_BxL=positions_BxL, segment_ids_BxL=segment_ids_BxL)
        return jax.lax.with_sharding_constraint([(r.expert_ids, r.gates) for r in aux.routing], replicated)

    def place(a):  # every process holds the whole batch: each device takes its rows
        return jax.make_array_from_callback(a.shape, rows, lambda index: a[index])

    routed, start = [], time.perf_counter()
    for batch in tqdm(batches, unit="batch", desc=f"routing {src.split}", disable=None if progress else True):
        out = route(state, *(place(batch[k]) for k in ("tokens", "positions", "segment_ids")))
        routed.append([(np.asarray(ids.addressable_data(0)), np.asarray(gates.addressable_data(0)))
                       for ids, gates in out])
    return accumulate.accumulate(run, batches, domain_names, lambda b: routed[b], tokens=tokens, n_samples=n_samples,
                                 n_frequent=n_frequent, seconds=time.perf_counter() - start)
