"""The whole jitted train step for a config on this backend: step time, tokens/s, MFU, peak device memory, per
dispatch path, grouped matmul, attention implementation and routed-expert count (8 -> 64 at fixed top-k and expert width: the step-time ratio).

    python -m benchmarks.train_step --preset cpu
    python -m benchmarks.train_step --preset gpu --dispatch dropless,capacity --experts 8,64   # configs/gpu_1b.py
    python -m benchmarks.train_step --preset gpu --grouped_matmul ragged_dot,blocked --attention_impl einsum,cudnn

MFU = model FLOPs (moe.accounting.train_flops_per_token, the loop's figure) / the measured peak of a large matmul
(bf16 on accelerators, fp32 on CPU: train.flops.measure_peak_flops) x devices.
"""


import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.common import PRESETS, arg_parser, describe, peak_memory_gb, preset, table, time_fn, variants
from configs.base import base_config
from moe import train_flops_per_token
from train import mesh as mesh_lib
from train import optim
from train.config import check, execution
from train.flops import measure_peak_flops
from train.state import init_state
from train.step import make_train_step


def _config(name: str, dispatch: str, n_experts: int, capacity_factor: float, grouped: str, attention: str,
            batch: int = 0):
    p = preset(name, n_experts)
    c = base_config()
    c.model.update(**p["model"])
    c.execution.update(**{**p["execution"], "dispatch": dispatch, "capacity_factor": capacity_factor,
                          "grouped_matmul": "auto" if grouped == "-" else grouped, "attention_impl": attention})
    c.data.seq_len = p["seq_len"]
    # The preset's batch is per device: on N devices the (data-parallel) step sees N times the rows.
    c.train.update(batch_size=(batch or p["batch"]) * jax.device_count(), steps=1000, warmup_steps=10)
    return c


def _batch(B: int, L: int, V: int, mesh):
    tokens = jax.random.randint(jax.random.key(1), (B, L + 1), 0, V)
    b = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.ones((B, L), jnp.int32),
         "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
         "loss_mask": jnp.ones((B, L), jnp.float32), "domains": jnp.zeros((B, L), jnp.int32)}
    return jax.device_put(b, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))


def bench(name, dispatch, n_experts, peak, capacity_factor=1.25, grouped="auto", attention="einsum", batch=0,
          steps=0) -> dict:
    c = _config(name, dispatch, n_experts, capacity_factor, grouped, attention, batch)
    mcfg, t = check(c), c.train
    mesh = mesh_lib.make_mesh(c.mesh)
    tx = optim.optimizer(t)
    graphdef, state, shardings = init_state(mcfg, tx, 0, mesh)
    run = jax.jit(make_train_step(graphdef, tx, optim.schedule(t), t, execution(c, mesh)))

    batch = _batch(t.batch_size, c.data.seq_len, mcfg.vocab_size, mesh)
    s = time_fn(lambda: run(state, batch)[1]["loss"], steps=steps or PRESETS[name]["steps"])
    tokens = t.batch_size * c.data.seq_len
    flops = train_flops_per_token(mcfg, c.data.seq_len) * tokens
    return {"dispatch": dispatch, "grouped matmul": grouped, "attention": attention, "experts": n_experts, "top_k": mcfg.top_k, "tokens/step": tokens,
            "step ms": s * 1e3, "tokens/s": tokens / s, "MFU %": 100 * flops / s / (peak * jax.device_count()),
            "peak GiB": peak_memory_gb()}


def main(argv=None):
    a = arg_parser(__doc__.splitlines()[0]).parse_args(argv)
    peak = a.peak_flops or measure_peak_flops()
    print(describe() + f" | matmul peak {peak / 1e12:.3g} TFLOP/s per device")
    experts_list = [int(e) for e in a.experts.split(",")]
    combos = [(d, g, att) for d, g in variants(a.dispatch.split(","), a.grouped_matmul.split(","))
              for att in a.attention_impl.split(",")]
    rows = [bench(a.preset, d, e, peak, a.capacity_factor, g, att, a.batch, a.steps) for d, g, att in combos
            for e in experts_list]
    print(table(rows))
    if len(experts_list) == 2:
        for d, g, att in combos:
            lo, hi = (r["step ms"] for r in rows
                      if (r["dispatch"], r["grouped matmul"], r["attention"]) == (d, g, att))
            print(f"{d} / {g} / {att}: step time x{hi / lo:.3f} from {experts_list[0]} to {experts_list[1]} "
                  "routed experts")


if __name__ == "__main__":
    main()
