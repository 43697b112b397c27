"""The benchmark scripts run and report sane figures (on CPU, one small combination each; timings not asserted)."""

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common, cpu_dots, moe_layer, profile_step, train_experts, train_step
from configs.default import get_config
from moe import router
from moe.dispatch import experts, kernels
from moe.dispatch.kernels import slab
from train.preflight import parse


def test_variants_cover_grouped_matmuls_only_where_they_apply():
    assert common.variants(["dropless", "capacity"], ["ragged_dot", "blocked"]) == [
        ("dropless", "ragged_dot"), ("dropless", "blocked"), ("capacity", "-")]


def test_moe_layer_rows_and_dense_baseline():
    rows = moe_layer.bench("cpu", 8, ["dropless", "capacity"], ["blocked"])
    # 1024 tokens x top-2 over 8 experts: 256 rows each when balanced; this router's experts have 309, 275, 258,
    # 257 and fewer rows, so `slab` takes slabs of the mean 256 rows and spills 53, 19, 2, 1 rows: 4 blocks of 64
    assert [r["path"] for r in rows] == ["dropless", "capacity",
                                         "dropless dispatch alone (grouped matmul = identity)",
                                         "expert matmuls alone, 256 rows each (this routing's slabs; + 4 spill blocks of 64)",
                                         "expert matmuls alone, 256 rows each (balanced)",
                                         "dense FFN (same active FLOPs)"]
    assert [r["routing"] for r in rows] == ["random"] * 4 + ["-", "-"]
    assert rows[0]["MaxVio"] == round(309 / 256 - 1, 3)
    assert all(r["ms"] > 0 and r["TFLOP/s"] > 0 for r in rows)
    assert rows[-1]["x dense"] == 1.0


def test_moe_layer_routing_is_an_input_of_the_timed_program(monkeypatch):
    """The routed rows' programs take the routing (ids, gates) as arguments: as constants XLA would fold the
    sort, the group sizes and slab's layout choice at compile time, which a train step cannot (on XLA:CPU,
    folded, the 64-expert layer reads ~2.4x dense where training's program runs ~3x)."""
    seen = []
    monkeypatch.setattr(moe_layer, "time_fns", lambda calls, steps: seen.extend(calls) or [1e-3] * len(calls))
    rows = moe_layer.bench("tiny", 8, ["dropless", "capacity"], ["slab"], steps=1)
    for row, (_, args) in zip(rows, seen, strict=True):  # a jitted function's arguments are its program's inputs
        routed = not row["path"].startswith(("expert matmuls alone", "dense FFN"))  # the dispatch paths
        assert any(a.dtype == jnp.int32 and a.shape[1:] == (2,) for a in args) == routed, row["path"]  # ids [T, K]


def test_dispatch_alone_is_dropless_without_its_matmuls():
    """The stand-in grouped matmul keeps dropless's permutation: each token gets back sum_k gate_k * x."""
    T, D, E, K = 12, 4, 3, 2
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids = jax.random.randint(jax.random.key(1), (T, K), 0, E)
    gates = jax.random.uniform(jax.random.key(2), (T, K))
    w = jnp.zeros((E, D, 5))
    y = experts.dropless(x, ids, gates, w, w, jnp.zeros((E, 5, D)), grouped=moe_layer._identity_grouped)
    assert jnp.allclose(y, x * gates.sum(1, keepdims=True), atol=1e-6)


def test_balanced_routing_is_what_the_bias_rule_leaves_on_a_fresh_batch():
    T, D, E, K = 2048, 32, 16, 2
    ks = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(ks[0], (D, E)) * D**-0.5 * 3  # a skewed router: a few experts favoured
    bias = moe_layer.balanced_bias(ks[1], T, D, w, K)
    x = jax.random.normal(ks[2], (T, D))  # not a batch the bias was fitted on
    maxvio = lambda b: float(router.max_violation(router.expert_load(router.route(x, w, b, top_k=K)[1], E)))
    assert maxvio(bias) < 0.5 * maxvio(bias * 0)


@pytest.mark.parametrize("script", [moe_layer, train_step])
@pytest.mark.parametrize("dispatch", ["dropless:atomic", "capacity:gather", ",", "teleport"])
def test_a_bad_dispatch_gets_one_line_and_exit_2_before_any_work(script, dispatch, capsys, monkeypatch):
    monkeypatch.setattr(train_step, "measure_peak_flops", lambda: pytest.fail("ran before checking --dispatch"))
    with pytest.raises(SystemExit) as e:
        script.main(["--preset", "tiny", "--dispatch", dispatch])
    assert e.value.code == 2 and "--dispatch" in capsys.readouterr().err


def test_dispatch_suffixes_pick_the_backward_rule():
    ap = common.arg_parser("x")
    assert common.dispatch_list(ap, "dropless:gather,expert_parallel:scatter,capacity") == [
        "dropless:gather", "expert_parallel:scatter", "capacity"]
    assert train_step._config("tiny", "dropless:gather", 8, 1.25, "-", "xla").execution.permute_grad == "gather"
    assert train_step._config("tiny", "dropless", 8, 1.25, "-", "xla").execution.permute_grad == "auto"


def test_moe_layer_routing_flag(capsys):
    moe_layer.main(["--preset", "tiny", "--dispatch", "dropless", "--grouped_matmul", "slab", "--experts", "8",
                    "--routing", "random,balanced,skewed,skewed@0.05", "--steps", "1"])
    out = capsys.readouterr().out
    assert all(f"| dropless | slab | {r} |" in out for r in ("random", "balanced", "skewed", "skewed@0.05"))
    with pytest.raises(SystemExit) as e:
        moe_layer.main(["--routing", "trained"])
    assert e.value.code == 2 and "--routing" in capsys.readouterr().err


def test_skewed_routing_loads_64_experts_past_every_gpu_slab():
    """--routing skewed, at configs/gpu_1b.py's widths (8,192 tokens here): mild at 8 experts, past the largest
    pure slab (3x the mean, MaxVio 2) at 64, where slab's fallback runs, as in a deep model at initialization;
    skewed@0.06 between the 2x and 3x slabs (the A/B of the 2.5x / 3x slabs against the fallback)."""
    T, D, K = 8192, 1024, 6
    for routing, E, lo, hi in (("skewed", 8, 0.05, 0.5), ("skewed", 64, 2.0, 3.5), ("skewed@0.06", 64, 1.0, 2.0)):
        ks = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(ks[0], (T, D))
        w = jax.random.normal(ks[1], (D, E)) * D**-0.5
        _, ids, _ = router.route(x, w, moe_layer._skew(routing) * jax.random.normal(ks[2], (E,)), top_k=K)
        assert lo < float(router.max_violation(jnp.bincount(ids.reshape(-1), length=E))) < hi
    for bad in ("skewed@", "skewed@x", "skewed@-1", "random@0.1"):
        assert not moe_layer._valid_routing(bad)


def test_slab_factor_variants_reach_the_grouped_matmul():

    fn = moe_layer._grouped("slab:1.25/1.5/1.75/2")  # pure slabs only: no spill layouts
    assert fn.keywords == {"fractions": (), "factors": (1.25, 1.5, 1.75, 2.0), "block": 64, "fallback_block": None}
    assert kernels.grouped_swiglu_for(fn) is fn
    assert moe_layer._grouped("blocked") == "blocked"
    spill = moe_layer._grouped("slab:spill")  # the CPU layouts on any backend: the GPU A/B
    assert spill.keywords == {"fractions": slab.SPILL_FRACTIONS, "factors": slab.SLAB_FACTORS,
                              "fallback_block": None}
    # @B: the fallback's block rows (the GPU's 512 against the 64 it had before)
    assert moe_layer._grouped("slab:1.25/1.5/2@64").keywords["fallback_block"] == 64
    assert moe_layer._grouped("slab@64").keywords == {"fallback_block": 64}
    spill512 = moe_layer._grouped("slab:spill512").keywords
    assert spill512["block"] == 512 and spill512["factors"] == slab.NO_SPILL_SLAB_FACTORS
    # its spill layouts sit after the 1.25x slab: a balanced routing's layout is the GPU default's
    lays = slab.layouts(196608, 64, spill512["fractions"], spill512["factors"], 512, 512)
    assert lays == ((3840, 0, 512), (3072, 96, 512), (4608, 0, 512), (6144, 0, 512), (7680, 0, 512), (9216, 0, 512),
                    (0, 448, 512))


def test_train_step_row(capsys):
    train_step.main(["--preset", "tiny", "--dispatch", "dropless", "--grouped_matmul", "blocked",
                     "--attention_impl", "xla", "--experts", "8", "--peak_flops", "1e12", "--batch", "2",
                     "--breakdown"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| dropless"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["dropless", "blocked", "xla", "8"]
    assert 0 <= float(cells[5]) <= 8 / 2 - 1  # MaxVio of the timed batch (8 experts, top-2: at most E / K - 1)
    assert int(cells[6]) == 8 * 2 * 32  # tokens/step: --batch 2 rows of 32 per (fake) device (the preset's: 1)
    mfu = float(cells[9])
    assert 0 < mfu < 100
    header = next(line for line in out.splitlines() if line.startswith("| dispatch"))
    assert header.rstrip(" |").endswith("peak GiB | planned GiB | compile s | scan layers | remat | fwd ms | fwd+bwd ms "
                                        "| opt ms")  # --breakdown
    assert cells[10] == "n/a"  # XLA:CPU reports no peak memory
    assert 0 < float(cells[11]) < 1  # XLA's plan for the tiny step: params, optimizer state, batch, temporaries
    assert float(cells[12]) > 0 and cells[13] == "off"  # the step's compile seconds; unrolled (the preset's)
    assert cells[14] == "off"  # no remat (the preset's)
    assert all(float(c) > 0 for c in cells[15:18])  # the step's parts, timed


def test_a_rows_peak_memory_is_shown_only_where_the_row_raised_the_process_peak(monkeypatch):
    peaks = iter([10.0, 10.0, 12.0])
    monkeypatch.setattr(common, "peak_memory_gb", lambda: next(peaks))
    assert common.row_peak_gb(10.0) is None  # a smaller row after a larger one: its own peak is unknown
    assert common.row_peak_gb(None) == 10.0  # the process's first row
    assert common.row_peak_gb(10.0) == 12.0


def test_train_step_scan_layers_and_remat_overrides():
    """--scan_layers on/off overrides the preset's execution.scan_layers; "" keeps it (off in every preset)."""
    args = ("dropless", 8, 1.25, "slab", "blockwise")
    assert train_step._config("cpu", *args, scan_layers="on").execution.scan_layers is True
    assert train_step._config("gpu", *args, scan_layers="off").execution.scan_layers is False
    assert train_step._config("gpu", *args).execution.scan_layers is False
    # --remat: off, or a policy; "" keeps the preset's (configs/gpu_1b.py: remat, save_moe)
    gpu = train_step._config("gpu", *args).execution
    assert gpu.remat is True and gpu.remat_policy == "save_moe"
    assert train_step._config("gpu", *args, remat="off").execution.remat is False
    ex = train_step._config("cpu", *args, remat="save_moe").execution
    assert ex.remat is True and ex.remat_policy == "save_moe"


def test_train_step_round_robin_rows(capsys):
    """--round_robin times every row together; the loss-chunks and loss columns appear for the rows that set
    them (the config's chunks, the fused loss: "-")."""
    train_step.main(["--preset", "tiny", "--dispatch", "capacity", "--experts", "8", "--peak_flops", "1e12",
                     "--batch", "1", "--loss_chunks", "0,4", "--loss", "fused,plain", "--round_robin", "--steps", "2"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, rows = lines[0], [[c.strip() for c in r.strip("|").split("|")] for r in lines[1:]]
    assert header.rstrip(" |").endswith("loss | loss chunks")  # columns in order of first appearance
    assert [r[-2:] for r in rows] == [["-", "-"], ["plain", "-"], ["-", "4"], ["plain", "4"]]
    assert all(float(r[7]) > 0 for r in rows)  # step ms


def test_train_experts_alternates_runs_and_reads_the_balanced_windows(tmp_path):
    c = train_experts.expert_config(get_config(), 64, 200)
    parse(c)
    assert c.model.n_routed_experts == 64 and c.model.top_k == 2 and c.eval.every > 200 and c.checkpoint.every > 200
    order = []

    def fake_run(config, workdir, log):  # tokens/s 1000 * 8 / E after step 100, garbage before
        E = config.model.n_routed_experts
        order.append(E)
        workdir.mkdir(parents=True)
        rows = [{"step": s, "tokens_per_sec": (1000 * 8 / E) if s > 100 else 1.0, "moe/layer_1/maxvio": 0.2,
                 "moe/layer_2/maxvio": 0.4} for s in range(10, 201, 10)]
        (workdir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    rows = train_experts.measure(get_config(), [8, 64], 200, 0.5, 2, tmp_path, keep=False, log=lambda *a: None,
                                 run=fake_run)
    assert order == [8, 64, 8, 64]
    assert [r["step time x first"] for r in rows] == [1.0, 8.0]
    assert rows[1]["MaxVio"] == pytest.approx(0.3) and rows[1]["windows"] == 10
    assert not any(tmp_path.iterdir())  # run directories removed without --keep


def test_train_experts_never_writes_into_a_nonempty_directory(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("a user's file")
    with pytest.raises(SystemExit) as e:
        train_experts.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "not empty" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "a user's file"


def test_profile_step_lists_the_steps_ops(capsys, tmp_path):
    profile_step.main(["--preset", "tiny", "--experts", "8", "--steps", "1", "--top", "8",
                       "--trace_dir", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")][1:]
    assert len(rows) == 8 and all(float(r[1]) > 0 for r in rows)
    assert any("dot_general" in r[4] for r in rows)  # op_name read back from the compiled HLO


def test_profile_step_sums_every_kernel_on_the_gpu_streams_once():
    """cuBLAS / cuDNN kernels, named other than any HLO op, count toward the device's busy time; the device's
    derived "XLA Ops" line (the same time again) and the host's events do not."""
    meta = lambda kind, pid, name, tid=None: {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}
    x = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur}
    events = [meta("process_name", 1, "/device:GPU:0"), meta("process_name", 2, "/host:CPU"),
              meta("thread_name", 1, "Stream #13(Compute)", 7), meta("thread_name", 1, "XLA Ops", 8),
              meta("thread_name", 2, "python", 9),
              x(1, 7, "sm90_xmma_gemm_bf16", 30), x(1, 7, "loop_add_fusion", 5), x(1, 7, "sm90_xmma_gemm_bf16", 10),
              x(1, 8, "loop_add_fusion", 5), x(2, 9, "sm90_xmma_gemm_bf16", 99)]
    assert profile_step.device_kernel_times(events) == {"sm90_xmma_gemm_bf16": 40, "loop_add_fusion": 5}
    assert profile_step.device_kernel_times([e for e in events if e["pid"] == 2]) == {}  # a CPU trace


def test_profile_step_maps_xlas_own_kernels_to_their_hlo_instruction():
    hlo = """
  %loop_select_fusion.18 = bf16[8,30720,1024]{2,1,0} fusion(%a, %b), kind=kLoop, calls=%f, metadata={op_name="jit(step)/select_n"}
  %fusion-done.2 = f32[4]{0} fusion-done(%c), metadata={op_name="jit(step)/dynamic_update_slice"}
  %custom-call.3 = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(%d, %e), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/dot_general"}
"""
    ops = profile_step.kernel_ops(profile_step.op_metadata(hlo))
    assert ops["loop_select_fusion_18"] == "loop_select_fusion.18" and ops["fusion_done_2"] == "fusion-done.2"
    assert "nvjet_sm90_tst_128x160" not in ops  # a cuBLAS kernel, named after no instruction


def test_cpu_dots_compiles_each_library_differently():
    """The compile options take effect: the batched dot goes to YNNPACK by default and to XLA's own dot under
    `eigen` (a renamed XLA flag would make every library the same program, and the table meaningless)."""
    args = (jnp.ones((4, 16, 32)), jnp.ones((4, 32, 16)))
    fn = lambda x, w: jnp.einsum("ecd,edf->ecf", x, w)
    hlo = {lib: cpu_dots.compiled(fn, args, lib).as_text() for lib in cpu_dots.LIBRARIES}
    assert "ynn_fusion" in hlo["default"]
    assert "ynn_fusion" not in hlo["eigen"] and " dot(" in hlo["eigen"]


def test_cpu_dots_table(capsys):
    cpu_dots.main(["--preset", "tiny", "--experts", "8", "--libraries", "default,eigen", "--steps", "1", "--step"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 ")]
    assert len(rows) == 10  # 4 ops x 2 libraries, then the train step under each (train_step.prepare, uncompiled)
    assert all(float(r[3]) > 0 for r in rows if r[1] == "train step (dropless)")
    by = {(r[1], r[2]): float(r[3]) for r in rows}
    batched = next(r for r in rows if r[1].startswith("gate dot, batched") and r[2] == "eigen")
    flat = next(op for op, lib in by if op.startswith("gate dot, flat"))
    assert float(batched[5].strip(" |")) == pytest.approx(by[(batched[1], "eigen")] / by[(flat, "eigen")], rel=1e-3)
    with pytest.raises(SystemExit) as e:
        cpu_dots.main(["--libraries", "mkl"])
    assert e.value.code == 2 and "--libraries" in capsys.readouterr().err
