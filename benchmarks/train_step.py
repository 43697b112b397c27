"""The whole jitted train step for a config on this backend: step time, tokens/s, MFU, peak device memory, per
dispatch path, grouped matmul, attention implementation and routed-expert count (8 -> 64 at fixed top-k and expert width: the step-time ratio).

    python -m benchmarks.train_step --preset cpu
    python -m benchmarks.train_step --preset gpu --dispatch dropless,capacity --experts 8,64   # configs/gpu_1b.py
    python -m benchmarks.train_step --preset gpu --grouped_matmul ragged_dot,blocked --attention_impl einsum,cudnn
    python -m benchmarks.train_step --preset default --experts 16 --attention_impl einsum,blockwise --round_robin
    # dropless's backward by scatter-adds or by gathers (execution.permute_grad; plain dropless: auto)
    python -m benchmarks.train_step --preset gpu --dispatch dropless:scatter,dropless:gather --grouped_matmul slab

MFU = model FLOPs (moe.accounting.train_flops_per_token, the loop's figure) / the measured peak of a large matmul
(bf16 on accelerators, fp32 on CPU: train.flops.measure_peak_flops) x devices.
`peak GiB` is the device's peak memory, shown only where the row raised the process's peak (JAX cannot reset it);
`planned GiB` is XLA's plan for one step (arguments and temporaries: the training loop donates the state, so the
updated state takes its buffers).
`compile s` is the step's lowering and compilation (XLA reuses what this process or JAX_COMPILATION_CACHE_DIR
already autotuned, so only a process's first row is cold); `scan layers` says whether the MoE blocks ran as one
lax.scan (moe/model.py), and `--scan_layers on,off` times both.

The MaxVio column is the timed batch's (mean over MoE layers; the router at initialization): `slab`'s slab follows the
busiest expert's rows, so the 8 -> 64 expert ratio depends on it. (A routing bias fitted to the fresh router's scores
balances the batches it was fitted on, MaxVio < 0.04, but not fresh ones, 0.5-1.7 per layer at 64 experts: at
initialization the tokens of a sequence route alike, so a batch's load swings like that of its 16 sequences. A
balanced train step needs a trained router: benchmarks.train_experts measures real training.)

--breakdown also times the step's parts on the same state and batch, round-robin with the step
(benchmarks.common.time_fns, so load hits all four alike): the forward pass alone (`fwd ms`), the forward +
backward pass (`fwd+bwd ms`) of the cross-entropy (without the optional balance loss), and the optimizer's update
alone (`opt ms`: clipping, AdamW and the new parameters, on gradients shaped like the parameters). Each part is a
program of its own writing fresh outputs (nothing donated), so the parts do not add up to `step ms`: compare a
part across rows (8 -> 64 experts), not with the step. The training loop donates its state, and the optimizer's
update runs faster donated.
"""


import functools
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.common import (
    PRESETS,
    add_remat_flag,
    arg_parser,
    comma_subset,
    describe,
    dispatch_list,
    peak_memory_gb,
    planned_memory_gb,
    preset,
    remat_label,
    remat_overrides,
    remat_settings,
    row_peak_gb,
    table,
    time_fns,
    variants,
)
from configs.base import base_config
from moe import train_flops_per_token
from moe.dispatch.execution import DISPATCH_MODES
from train import host_memory, optim
from train import mesh as mesh_lib
from train.flops import measure_peak_flops
from train.preflight import parse
from train.state import init_state
from train.step import forward, make_train_step, objective


def _config(name: str, dispatch: str, n_experts: int, capacity_factor: float, grouped: str, attention: str,
            batch: int = 0, loss_chunks: int = 0, scan_layers: str = "", remat: str = ""):
    p = preset(name, n_experts)
    c = base_config()
    c.model.update(**p["model"])
    dispatch, _, permute = dispatch.partition(":")  # dropless:scatter / dropless:gather: execution.permute_grad
    c.execution.update(**{**p["execution"], "dispatch": dispatch, "capacity_factor": capacity_factor,
                          **({"permute_grad": permute} if permute else {}),
                          "grouped_matmul": "auto" if grouped == "-" else grouped, "attention_impl": attention,
                          **({"loss_chunks": loss_chunks} if loss_chunks else {}),
                          **({"scan_layers": scan_layers == "on"} if scan_layers else {}),
                          **remat_overrides(remat)})
    c.data.seq_len = p["seq_len"]
    # The preset's batch is per device: on N devices the (data-parallel) step sees N times the rows.
    c.train.update(batch_size=(batch or p["batch"]) * jax.device_count(), steps=1000, warmup_steps=10)
    return c


def random_batch(B: int, L: int, V: int) -> dict:
    """A batch of B rows of L random tokens (one unbroken sequence per row), as the data pipeline shapes it."""
    tokens = jax.random.randint(jax.random.key(1), (B, L + 1), 0, V)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.ones((B, L), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
            "loss_mask": jnp.ones((B, L), jnp.float32), "domains": jnp.zeros((B, L), jnp.int32)}


def batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def _batch(B: int, L: int, V: int, mesh):
    return jax.device_put(random_batch(B, L, V), batch_sharding(mesh))


def _parts(graphdef, ex, forward_fn, tx):
    """Jitted forward and forward + backward of the step's loss (train.step.objective), and the optimizer's
    update (tx on gradients shaped like the parameters, then the new parameters), for --breakdown."""
    def loss(params, bias, batch):
        return objective(*forward_fn(graphdef, params, bias, batch, ex))

    def update(params, opt, grads):
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    fwd = jax.jit(loss)
    grad = jax.jit(jax.grad(loss))
    opt_update = jax.jit(update)
    return (lambda state, batch: fwd(state["params"], state["bias"], batch),
            lambda state, batch: grad(state["params"], state["bias"], batch),
            lambda state, batch: opt_update(state["params"], state["opt"], state["params"]))


def prepare(name, dispatch, n_experts, peak, capacity_factor=1.25, grouped="auto", attention="blockwise", batch=0,
            breakdown=False, loss_chunks=0, loss="fused", scan_layers="", remat="", compile_step=True):
    """(calls, finish): the (fn, args) to time -- the step, then with `breakdown` its forward pass, forward +
    backward pass and optimizer update -- and finish(seconds per call of each) -> the table row. scan_layers:
    "on" / "off" overrides execution.scan_layers, remat "off" or a policy execution.remat / remat_policy ("": the
    preset's). The step is compiled here and the seconds it took go into the row (`jax.stages.Compiled`);
    compile_step=False returns the jitted step instead, for callers that compile it their own way
    (benchmarks/cpu_dots.py)."""
    peak_before = peak_memory_gb()
    c = _config(name, dispatch, n_experts, capacity_factor, grouped, attention, batch, loss_chunks, scan_layers,
                remat)
    mcfg, t = parse(c).model, c.train
    mesh = mesh_lib.make_mesh(c.mesh)
    tx = optim.optimizer(t)
    graphdef, state, shardings = init_state(mcfg, tx, 0, mesh)
    ex = parse(c).execution_on(mesh)
    fwd = functools.partial(forward, fused_loss=loss == "fused")
    batch = _batch(t.batch_size, c.data.seq_len, mcfg.vocab_size, mesh)
    run, compile_s = jax.jit(make_train_step(graphdef, tx, optim.schedule(t), t, ex, fwd)), None
    if compile_step:
        t0 = time.perf_counter()
        run = run.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
    calls = [(run, (state, batch))]
    if breakdown:
        calls += [(part, (state, batch)) for part in _parts(graphdef, ex, fwd, tx)]
    tokens = t.batch_size * c.data.seq_len
    flops = train_flops_per_token(mcfg, c.data.seq_len) * tokens

    def finish(seconds: list[float]) -> dict:
        s = seconds[0]
        maxvio = jax.device_get(run(state, batch)[1]["maxvio"])  # the timed batch's, per MoE layer
        row = {"dispatch": dispatch, "grouped matmul": grouped, "attention": attention, "experts": n_experts,
               "top_k": mcfg.top_k, "MaxVio": float(maxvio.mean()) if maxvio.size else None,
               "tokens/step": tokens, "step ms": s * 1e3, "tokens/s": tokens / s,
               "MFU %": 100 * flops / s / (peak * jax.device_count()), "peak GiB": row_peak_gb(peak_before),
               "planned GiB": planned_memory_gb(run) if compile_step else None,
               "compile s": compile_s, "scan layers": "on" if ex.scan_layers else "off",
               "remat": remat_label(ex)}
        if loss_chunks:
            row["loss chunks"] = loss_chunks
        if loss != "fused":
            row["loss"] = loss
        if breakdown:
            row["fwd ms"], row["fwd+bwd ms"], row["opt ms"] = (x * 1e3 for x in seconds[1:4])
        return row

    return calls, finish


def bench(name, dispatch, n_experts, peak, capacity_factor=1.25, grouped="auto", attention="blockwise", batch=0,
          steps=0, breakdown=False, loss_chunks=0, loss="fused", scan_layers="", remat="") -> dict:
    """One row, timed on its own (the step and its parts round-robin)."""
    calls, finish = prepare(name, dispatch, n_experts, peak, capacity_factor, grouped, attention, batch, breakdown,
                            loss_chunks, loss, scan_layers, remat)
    return finish(time_fns(calls, steps or PRESETS[name]["steps"]))


def bench_round_robin(specs: list[dict], name: str, peak, steps=0) -> list[dict]:
    """Every row's calls timed round-robin together (all compiled and held in memory at once: for A/B runs on a
    shared CPU, where load drifts between rows timed one after another)."""
    prepared = [prepare(name, peak=peak, **spec) for spec in specs]
    seconds = time_fns([call for calls, _ in prepared for call in calls], steps or PRESETS[name]["steps"])
    rows, i = [], 0
    for calls, finish in prepared:
        # The device's peak memory is one figure for all rows here (they run interleaved): not per row.
        rows.append({**finish(seconds[i:i + len(calls)]), "peak GiB": None})
        i += len(calls)
    return rows


def expert_ratio(label: str, rows: list[dict], experts: list[int]) -> str:
    """The step-time ratio of two rows timed at experts[0] and experts[1] routed experts, as one line."""
    lo, hi = (r["step ms"] for r in rows)
    return f"{label}: step time x{hi / lo:.3f} from {experts[0]} to {experts[1]} routed experts"


def main(argv=None):
    ap = arg_parser(__doc__.splitlines()[0])
    ap.add_argument("--breakdown", action="store_true", help="also time the forward pass, the forward + backward pass and the optimizer's update")
    ap.add_argument("--loss_chunks", default="0",
                    help="execution.loss_chunks values, comma-separated (0: the config's, 8 by default)")
    ap.add_argument("--loss", default="fused",
                    help="fused (the train step's: the LM head's gradient in the forward pass, moe/lm_loss.py) or "
                         "plain (autodiff of the per-token loss), comma-separated")
    ap.add_argument("--scan_layers", default="",
                    help="on, off or both (on,off): execution.scan_layers, the MoE blocks as one lax.scan (default: "
                         "the preset's)")
    add_remat_flag(ap)
    ap.add_argument("--round_robin", action="store_true",
                    help="time all rows together, round-robin (all held in memory at once: CPU A/B runs; no "
                         "per-row peak memory)")
    a = ap.parse_args(argv)
    dispatches = dispatch_list(ap, a.dispatch, DISPATCH_MODES)
    host_memory.keep_freed_memory()  # as `python -m train` runs (train/host_memory.py)
    peak = a.peak_flops or measure_peak_flops()
    print(describe() + f" | matmul peak {peak / 1e12:.3g} TFLOP/s per device")
    experts_list = [int(e) for e in a.experts.split(",")]
    scans = comma_subset(ap, "--scan_layers", a.scan_layers, ("on", "off")) if a.scan_layers else [""]
    remats = remat_settings(ap, a.remat)
    combos = [(d, g, att, int(ch), lo, sc, r)
              for d, g in variants(dispatches, a.grouped_matmul.split(","))
              for att in a.attention_impl.split(",") for ch in a.loss_chunks.split(",") for lo in a.loss.split(",")
              for sc in scans for r in remats]
    specs = [dict(dispatch=d, n_experts=e, capacity_factor=a.capacity_factor, grouped=g, attention=att,
                  batch=a.batch, breakdown=a.breakdown, loss_chunks=ch, loss=lo, scan_layers=sc, remat=r)
             for d, g, att, ch, lo, sc, r in combos for e in experts_list]
    if a.round_robin:
        rows = bench_round_robin(specs, a.preset, peak, a.steps)
    else:  # each row printed when done: a deep model's compile takes minutes, a time limit may end the run first
        rows = []
        for spec in specs:
            rows.append(bench(a.preset, peak=peak, steps=a.steps, **spec))
            print(table(rows[-1:]), flush=True)
    print(table(rows))
    if len(experts_list) == 2:
        for i, (d, g, att, ch, loss, sc, r) in enumerate(combos):
            extra = (f" / loss_chunks {ch}" if ch else "") + (f" / {loss} loss" if loss != "fused" else "") \
                + (f" / scan_layers {sc}" if sc else "") + (f" / remat {r}" if r else "")
            print(expert_ratio(f"{d} / {g} / {att}{extra}", rows[2 * i:2 * i + 2], experts_list))


if __name__ == "__main__":
    main()
