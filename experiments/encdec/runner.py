"""Encoder-decoder vs decoder-only, 2x2 at P and 2P parameters: is the encoder-decoder's edge
on an input->output task only its extra parameters?

    python -m experiments.encdec --out runs/encdec_study [--config experiments/masks_round2/config.py]
        [--seeds 2] [--steps N] [--decoder_mask causal|prefix] [--cells decoder_P,encdec_P,...] [--report_only]
        [--lr_grid 1.5e-3,3e-3,6e-3] [--config.KEY=VALUE ...]

Cells, from the study config's model (L = model.n_layers, even; every layer MoE, model.first_k_dense = 0):
  decoder_P    decoder-only, L layers                      decoder_2P   decoder-only, 2L layers
  encdec_P     L/2 encoder + L/2 decoder layers            encdec_2P    L encoder + L decoder layers
The decoder-only cells use --decoder_mask (causal: the GPT the page argues for; prefix: the non-causal decoder).
The encoder-decoder (experiments/encdec/model.py) is built from the same blocks; its cross-attention is its only
extra weight.
Every cell trains with the same step (train.step.make_train_step), optimizer, schedule and data order for a seed,
on the same targets (experiments.encdec.task: the output half of every window), and is scored on every validation
window, also by output position (the first output token depends most on the input's end); the input-replacement
gap says whether it uses its input. Exact parameter counts go in the report.
With --lr_grid every cell first trains once per rate on a held-out seed and runs its comparison seeds at the best
one (experiments.common.lr_select, docs/inference.md rule 10); without it every cell runs at train.lr.

A run is minutes (no checkpoints): OUT/<cell>/seed<k>/result.json is written atomically when it ends, and a
finished run is skipped when the same command runs again; a stopped run starts over. The report is
OUT/report/report.md (OUT/report_<cells>/ for a --cells subset), with the mask study's gate (the decoder_P cell
against the bigram reference; experiments.encdec.report).
"""

import copy
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from experiments.common import lr_select
from experiments.common.cli import seeds_and_steps, study_parser, use_compilation_cache
from experiments.common.probes import replace_inputs
from experiments.common.refs import study_references
from experiments.common.rows import all_rows, first_rows_per_domain, token_weighted
from experiments.common.runs import fingerprint
from experiments.encdec import task as encdec_task
from experiments.encdec.model import EncoderDecoder, n_params
from experiments.encdec.report import CELLS, write_report
from moe import ConfigError, Transformer
from moe.sharding import make_mesh
from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with, os_error
from rundir.atomic import write_text
from rundir.provenance import provenance
from train import optim, step
from train.command_line import config_from_argv
from train.inputs import sampler as make_sampler
from train.inputs import task_cache
from train.preflight import parse
from train.state import init_state

DEFAULT_CONFIG = "experiments/masks_round2/config.py"
GAP_ROWS_PER_DOMAIN = 24


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str
    encoder_layers: int  # 0: decoder-only; else model.n_layers is the decoder's depth


def cell_config(base, cell: str, seed: int, steps: int, decoder_mask: str, lr: float | None = None):
    """(config, Cell) of one run: model.n_layers is the decoder-only depth, or the encoder-decoder's decoder
    depth (its encoder has as many layers); lr: the cell's learning rate (default train.lr)."""
    c = copy.deepcopy(base)
    kind, scale = cell.split("_")
    depth = int(base.model.n_layers) * (2 if scale == "2P" else 1)
    c.model.n_layers = depth if kind == "decoder" else depth // 2
    # Every layer MoE in every cell: with first_k_dense = 1 the encoder-decoder would have a dense layer per
    # stack, i.e. fewer MoE layers and fewer parameters than the decoder-only model of the same depth.
    c.model.first_k_dense = 0
    c.model.mask = decoder_mask if kind == "decoder" else "causal"
    c.train.seed, c.train.steps, c.train.prefix_loss = seed, steps, False
    if lr is not None:
        c.train.lr = lr
    return c, Cell(cell, 0 if kind == "decoder" else depth // 2)


def run_key(c, cell: Cell) -> str:
    """Names a finished run: the config's fingerprint and the cell (the encoder is not a config key)."""
    return f"{cell.name}/{cell.encoder_layers}/{fingerprint(c)}"


def build_fn(c, cell: Cell):
    """(build(mcfg, rngs), forward_fn, rows -> batch) of a cell."""
    n_enc = cell.encoder_layers
    if not n_enc:
        return Transformer, step.train_forward, lambda rows: rows
    S, T = encdec_task.lengths(int(c.data.seq_len), float(c.data.prefix_frac))
    return (functools.partial(EncoderDecoder, n_encoder_layers=n_enc), encdec_task.forward,
            lambda rows: encdec_task.encdec_rows(rows, S, T))


def _counts(build, mcfg) -> dict:
    model = nnx.eval_shape(lambda: build(mcfg, nnx.Rngs(0)))
    total = n_params(model)
    embed = 2 * mcfg.vocab_size * mcfg.d_model  # the embedding table and the LM head
    return {"params": int(total), "params_non_embedding": int(total - embed)}


def row_losses(loss_fn, state, to_batch, rows, batch_size: int) -> np.ndarray:
    out = []
    for i in range(0, len(rows["tokens"]), batch_size):
        part = {k: v[i:i + batch_size] for k, v in rows.items()}
        n = len(part["tokens"])
        if n < batch_size:  # one compiled shape: pad with copies of the last row, dropped below
            part = {k: np.concatenate([v, np.repeat(v[-1:], batch_size - n, 0)]) for k, v in part.items()}
        out.append(np.asarray(loss_fn(state, to_batch(part)))[:n])
    return np.concatenate(out)


def train_cell(c, cell: Cell, log=print) -> dict:
    """Train one cell from scratch and measure it: curves, final loss on every validation window, the gap."""
    mcfg = parse(c).model
    build, forward_fn, to_batch = build_fn(c, cell)
    t = c.train
    mesh = make_mesh(1, 1, 1, 1, devices=jax.devices()[:1])
    ex = parse(c).execution_on(mesh)
    tx = optim.optimizer(t)
    graphdef, state, _ = init_state(mcfg, tx, int(t.seed), mesh, build)
    train_step = jax.jit(step.make_train_step(graphdef, tx, optim.schedule(t), t, ex, forward_fn),
                         donate_argnums=0)
    loss_fn = encdec_task.row_loss_fn(forward_fn, graphdef, ex)
    position_fn = encdec_task.output_position_loss_fn(forward_fn, graphdef, ex)
    sampler, _ = make_sampler(c)
    val = all_rows(c)
    curve_rows = first_rows_per_domain(val, int(c.eval.rows_per_domain))
    eb = int(c.eval.batch_size)
    curve, train_curve = [], []
    t0 = time.perf_counter()
    for i in range(int(t.steps)):
        state, m = train_step(state, to_batch(sampler.batch(i, int(t.batch_size))))
        done = i + 1
        if done % int(c.log.every) == 0 or done == t.steps:
            train_curve.append((done, float(m["loss"])))
        if done % int(c.eval.every) == 0 or done == t.steps:
            loss, _ = token_weighted(row_losses(loss_fn, state, to_batch, curve_rows, eb), curve_rows)
            curve.append((done, loss))
            log(f"  step {done}/{t.steps}: val loss {loss:.4f} ({time.perf_counter() - t0:.0f} s)")
    seconds = time.perf_counter() - t0
    # One pass over every validation window: per-row bucket sums give the row losses and the position table.
    sums_Rx2xK = row_losses(position_fn, state, to_batch, val, eb)
    ce_R, n_R = sums_Rx2xK.sum(-1).T
    rl = np.where(n_R > 0, ce_R / np.maximum(n_R, 1), np.nan)
    val_loss, by_dom = token_weighted(rl, val)
    by_position = encdec_task.by_output_position(sums_Rx2xK)
    gap_rows = first_rows_per_domain(val, GAP_ROWS_PER_DOMAIN)
    own = row_losses(loss_fn, state, to_batch, gap_rows, eb)
    other = row_losses(loss_fn, state, to_batch, replace_inputs(gap_rows, seed=int(t.seed)), eb)
    names = task_cache(c.data, c.data.eval_split).domain_names
    return {"cell": cell.name, "seed": int(t.seed), "steps": int(t.steps), "lr": float(t.lr), "key": run_key(c, cell),
            "decoder_mask": None if cell.encoder_layers else c.model.mask,
            "n_layers": int(c.model.n_layers), "encoder_layers": cell.encoder_layers,
            **_counts(build, mcfg), "train_seconds": seconds,
            "tokens_seen": int(t.steps * t.batch_size * c.data.seq_len),
            "val_loss": val_loss, "val_loss_by_domain": {names[d]: v for d, v in by_dom.items()},
            "input_replacement_gap": float(np.nanmean(other) - np.nanmean(own)),
            "val_loss_by_output_position": by_position,
            "val_curve": curve, "train_curve": train_curve}


def run_cell(c, cell: Cell, workdir: Path, log=print) -> dict:
    cache = workdir / "result.json"
    if cache.exists():
        result = json.loads(cache.read_text())
        if result.get("key") != run_key(c, cell):
            raise UserError(f"{workdir} holds a finished run with a different config; use another --out")
        log(f"{workdir}: cached (val/loss {result['val_loss']:.4f})")
        return result
    result = train_cell(c, cell, log)
    workdir.mkdir(parents=True, exist_ok=True)
    write_text(cache, json.dumps({**result, "provenance": provenance()}))
    return result


def cached_result(c, cell: Cell, workdir: Path) -> dict | None:
    """The finished run's result when it was made with this config, else None (--report_only trains nothing)."""
    cache = workdir / "result.json"
    res = json.loads(cache.read_text()) if cache.exists() else None
    return res if res is not None and res.get("key") == run_key(c, cell) else None


def run_study(base, seeds: int, steps: int, out, decoder_mask: str, log=print, report_only=False,
              cells=CELLS, lr_grid=None) -> Path:
    """Train (or reuse) every cell x seed and write the report; lr_grid: select each cell's rate first."""
    out = Path(out)
    for cell in cells:
        for lr in lr_grid or (None,):
            parse(cell_config(base, cell, 0, steps, decoder_mask, lr)[0])
    out.mkdir(parents=True, exist_ok=True)
    refs = study_references(cell_config(base, "decoder_P", 0, steps, "causal")[0], out, log)
    chosen = {}
    if lr_grid:
        def sweep_run(cell, lr, seed, workdir):
            c, cl = cell_config(base, cell, seed, steps, decoder_mask, lr)
            return cached_result(c, cl, workdir) if report_only else run_cell(c, cl, workdir, log)
        chosen = lr_select.select(cells, lr_grid, sweep_run, out, log)
    runs = [(cell, s) for s in range(seeds) for cell in cells]  # seed-major: a cut-short study stays paired
    configs = {(cell, s): cell_config(base, cell, s, steps, decoder_mask, chosen.get(cell, {}).get("lr"))
               for cell, s in runs}
    results = []
    for i, (cell, s) in enumerate(runs):
        workdir = out / cell / f"seed{s}"
        if report_only:
            res = cached_result(*configs[(cell, s)], workdir)
            if res is not None:
                results.append(res)
            continue
        log(f"[{i + 1}/{len(runs)}] {cell} seed {s}")
        results.append(run_cell(*configs[(cell, s)], workdir, log))
    if not any(r["cell"] == "decoder_P" for r in results):
        raise UserError(f"no finished decoder_P runs in {out} for these settings; run without --report_only first")
    # A subset of the cells reports beside the full 2x2, never over it (Holm runs over the contrasts present).
    name = "report" if tuple(cells) == CELLS else "report_" + "+".join(cells)
    return write_report(results, refs, out / name, base, decoder_mask, chosen)


def parser() -> ArgParser:
    mask = (("--decoder_mask",), {"default": "causal", "help": "the decoder-only cells' mask: causal or prefix"})
    cells = (("--cells",), {"default": ",".join(CELLS),
                            "help": "comma-separated cells to train and report (decoder_P, which the gate is "
                                    "measured on, always among them)"})
    grid = (("--lr_grid",), {"default": None, "help": "comma-separated learning rates: choose each cell's rate on a "
                                                     f"held-out seed ({lr_select.HELD_OUT_SEED}) first"})
    return study_parser("python -m experiments.encdec", __doc__, DEFAULT_CONFIG, "runs/encdec_study", 2,
                        "paired seeds per cell (train.seed = 0 .. seeds-1)", extra=(mask, cells, grid))


def parse_flags(argv):
    config, _, rest = config_from_argv(list(argv[1:]), DEFAULT_CONFIG)
    args = parser().parse_args(rest)
    steps = seeds_and_steps(args, config, min_seeds=2)
    if args.decoder_mask not in ("causal", "prefix"):
        raise UserError(f"--decoder_mask takes causal or prefix, got {args.decoder_mask!r}")
    cells = tuple(args.cells.split(","))
    unknown = sorted(set(cells) - set(CELLS))
    if unknown or "decoder_P" not in cells:
        raise UserError(f"--cells takes a comma-separated subset of {','.join(CELLS)} that includes decoder_P "
                        f"(the gate's cell), got {args.cells!r}")
    args.cells = tuple(c for c in CELLS if c in cells)
    args.lr_grid = lr_select.parse_grid(args.lr_grid) if args.lr_grid is not None else None
    if config.data.task != "prefix":
        raise UserError("the 2x2 needs input->output rows: set --config.data.task=prefix")
    if config.model.tie_embeddings:
        raise UserError("model.tie_embeddings is not supported by the encoder-decoder (it has its own LM head); "
                        "run the 2x2 with --config.model.tie_embeddings=false")
    if int(config.model.n_layers) % 2:
        raise UserError(f"model.n_layers must be even (encdec_P splits it into encoder and decoder halves), got "
                        f"{config.model.n_layers}")
    return config, args, steps


def main(argv=None):
    argv = sys.argv if argv is None else argv
    if any(a in ("-h", "--help") for a in argv[1:]):
        parser().print_help()
        raise SystemExit(0)
    try:
        config, args, steps = parse_flags(argv)
        use_compilation_cache(args.out)  # the seeds of a cell compile the same programs
        report = run_study(config, args.seeds, steps, args.out, args.decoder_mask, report_only=args.report_only,
                           cells=args.cells, lr_grid=args.lr_grid)
    except (UserError, ConfigError) as e:
        exit_with(e)
    except KeyboardInterrupt:
        exit_with(UserError("interrupted; re-run the same command to resume the study (finished runs are kept)"),
                  130)
    except OSError as e:
        exit_with(os_error(e))
    print(f"wrote {report}")
