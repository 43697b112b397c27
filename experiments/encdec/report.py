"""The encoder-decoder 2x2's report (experiments.encdec.runner writes it): the mask study's gate on decoder_P, the
cells with their learning rates, parameters, compute and stall rates, the declared family of paired contrasts under
docs/inference.md's rules, the loss by output position, and figures. A pure function of the runs' result.json files,
the references and the learning-rate selection, so --report_only rebuilds it without training."""

import json
from pathlib import Path

import numpy as np

from experiments.common import lr_select, plots
from experiments.common.stats import gate
from experiments.common.verdicts import cell_gate, decide, family_table, member
from experiments.encdec import task as encdec_task
from rundir.atomic import write_text

CELLS = ("decoder_P", "decoder_2P", "encdec_P", "encdec_2P")
# The report's declared family (docs/inference.md rules 1-2), fixed before any run: each a - b (negative = a has
# the lower loss), gated on b. The question is the first three: at equal parameters, and against a decoder-only
# model with as many parameters as the larger encoder-decoder.
CONTRASTS = (("encdec_P", "decoder_P"), ("encdec_2P", "decoder_2P"), ("encdec_P", "decoder_2P"),
             ("decoder_2P", "decoder_P"), ("encdec_2P", "encdec_P"))


def groups(results) -> dict:
    """{cell: {seed: result}} of the cells present."""
    out = {}
    for r in results:
        out.setdefault(r["cell"], {})[r["seed"]] = r
    return out


def contrast_rows(results, bigram: float) -> list[dict]:
    """The family's members with two paired seeds or more, Holm across them (inference.family): the contrasts of
    the cells present, since a --cells subset reports its own, smaller family."""
    g = groups(results)
    members = []
    for a, b in CONTRASTS:
        if a in g and b in g and len(set(g[a]) & set(g[b])) >= 2:
            members.append(member("encdec", f"{a} - {b}", None, g[a], g[b], bigram, an=a))
    return decide(members)


def position_labels(edges) -> list[str]:
    """1-based output-token ranges of the buckets [e_i, e_i+1): 1, 2, 3-4, ..., 65+."""
    ends = [*edges[1:], None]
    return [f"{a + 1}+" if b is None else str(b) if b == a + 1 else f"{a + 1}-{b}" for a, b in zip(edges, ends)]


def position_table(results) -> tuple[list[str], dict]:
    """(bucket labels, {cell: (mean loss per bucket over the seeds that measured it, n seeds)}); runs from before
    the measurement (no `val_loss_by_output_position`) or with other buckets than today's are left out."""
    edges = list(encdec_task.POSITION_EDGES)
    table = {}
    for cell in CELLS:
        rs = [r["val_loss_by_output_position"] for r in results
              if r["cell"] == cell and r.get("val_loss_by_output_position", {}).get("edges") == edges]
        if rs:
            loss = [None if any(r["loss"][k] is None for r in rs) else float(np.mean([r["loss"][k] for r in rs]))
                    for k in range(len(edges))]
            table[cell] = (loss, len(rs))
    return (position_labels(edges) if table else []), table


def position_lines(results) -> list[str]:
    labels, table = position_table(results)
    if not table:
        return []
    cells = list(table)
    lines = ["## Loss by output position", "",
             "Validation loss of every validation window by the output token's position (1 = the first token "
             "after the input, which depends most on the input's end), mean over the seeds that measured it.", "",
             "| output token | " + " | ".join(f"{c} ({table[c][1]})" for c in cells) + " |",
             "|---|" + "---|" * len(cells)]
    for k, label in enumerate(labels):
        vals = [table[c][0][k] for c in cells]
        lines.append(f"| {label} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in vals) + " |")
    return lines + ["", "![loss by output position](output_position.png)", ""]


def write_figures(results, refs, contrasts, out: Path) -> None:
    groups = {cell: {r["seed"]: r for r in results if r["cell"] == cell} for cell in CELLS}
    groups = {cell: runs for cell, runs in groups.items() if runs}
    plots.plot_curves(groups, refs, out / "val_curves.png")
    if contrasts:
        plots.plot_contrasts(contrasts, out / "paired_loss.png", "validation loss difference (nats)",
                                   "Paired by seed: first cell - second cell (negative: the first is better)")
    plots.plot_domains(groups, refs, out / "domains.png")
    labels, table = position_table(results)
    if table:
        plots.plot_output_position(labels, table, out / "output_position.png",
                                         "Validation loss by output position (mean over seeds)")


def block_passes(result, seq_len: int, prefix_frac: float) -> int:
    """Tokens x blocks per window, the cells table's compute proxy: a decoder-only block runs on every token of
    the window, the encoder's on the padded source and the decoder's on the padded output."""
    if not result["encoder_layers"]:
        return result["n_layers"] * seq_len
    S, T = encdec_task.lengths(seq_len, prefix_frac)
    return result["encoder_layers"] * S + result["n_layers"] * T


def write_report(results, refs, out: Path, base, decoder_mask: str, lr_choice=None) -> Path:
    """lr_choice: experiments.common.lr_select's per-cell selection, when the cells ran at their own rates."""
    L, frac = int(base.data.seq_len), float(base.data.prefix_frac)
    S, T = encdec_task.lengths(L, frac)
    reference = int(base.model.n_layers) * L  # decoder_P
    base_cells = [r for r in results if r["cell"] == "decoder_P"]
    g = gate(float(np.mean([r["val_loss"] for r in base_cells])), refs["bigram"],
             float(np.mean([r["val_loss"] + r["input_replacement_gap"] for r in base_cells])))
    lines = ["# Encoder-decoder vs decoder-only, 2x2", "",
             f"{len(results)} runs. Decoder-only cells use the {decoder_mask} mask. Model d_model "
             f"{base.model.d_model}, {base.model.n_routed_experts} routed experts top-{base.model.top_k} + "
             f"{base.model.n_shared_experts} shared; {base.data.seq_len}-token windows, input = first "
             f"{base.data.prefix_frac:.0%}, loss on the output; batch {base.train.batch_size}, "
             f"{results[0]['steps']} steps ({results[0]['tokens_seen']:,} tokens per run), "
             + ("each cell at its own learning rate (below)." if lr_choice else f"lr {base.train.lr}."),
             "", "## Gate (the mask study's, on decoder_P)", "",
             "| quantity | value |", "|---|---|",
             f"| bigram reference | {refs['bigram']:.4f} |",
             f"| decoder_P val loss, mean over seeds | {np.mean([r['val_loss'] for r in base_cells]):.4f} |",
             f"| beats bigram by | {g['beats_bigram_by']:+.4f} (need >= 0.3) |",
             f"| input-replacement gap | {g['input_replacement_gap']:+.4f} (need >= 0.1) |",
             f"| **verdict** | **{'interpretable' if g['passed'] else 'not interpretable'}** |", "",
             *lr_select.report_lines(lr_choice or {}),
             "## Cells", "",
             "Compute per window: token x block passes (a decoder-only block runs on all "
             f"{base.data.seq_len} tokens; the encoder's on the {S}-token source, the decoder's on the {T}-token "
             "output), relative to decoder_P: the encoder-decoder spends about half the compute of a decoder-only "
             "model with as many blocks.", "",
             f"Stalled: seeds more than 0.2 nats above the mean of the cell's faster half (docs/inference.md rule 6); "
             f"gate: the cell's mean at least 0.3 below the bigram ({refs['bigram']:.4f}) and an input gap of 0.1.", "",
             "| cell | lr | layers (enc + dec) | params (non-embedding) | compute per window | val loss per seed | mean | "
             "input-replacement gap | gate (seeds passing) | stalled | train s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in CELLS:
        rs = sorted((r for r in results if r["cell"] == cell), key=lambda r: r["seed"])
        if not rs:
            continue
        r0, per_seed = rs[0], ", ".join(f"{r['val_loss']:.4f}" for r in rs)
        cg = cell_gate({r["seed"]: r for r in rs}, refs["bigram"])
        lr = r0.get("lr", float(base.train.lr))
        lines.append(f"| {cell} | {lr:g} | {r0['encoder_layers']} + {r0['n_layers']} | {r0['params']:,} "
                     f"({r0['params_non_embedding']:,}) | x{block_passes(r0, L, frac) / reference:.2f} | {per_seed} | "
                     f"{np.mean([r['val_loss'] for r in rs]):.4f} | "
                     f"{np.mean([r['input_replacement_gap'] for r in rs]):+.4f} | "
                     f"{'passes' if cg['passed'] else 'fails'} ({cg['seeds_passing']}) | {cg['stall_rate']} | "
                     f"{np.mean([r['train_seconds'] for r in rs]):.0f} |")
    contrasts = contrast_rows(results, refs["bigram"])
    lines += ["", "## Contrasts under docs/inference.md's rules", "",
              f"The family, declared in experiments/encdec/report.py before any run: the {len(contrasts)} contrasts "
              "below (a - b, validation loss, paired by seed; negative = a has the lower loss), Holm across them. "
              "Each is gated on its reference cell b. \"a better\" / \"a worse\": Holm p < 0.05, the gate passes "
              "and the Hodges-Lehmann estimate agrees in sign; \"equivalent\": Holm-corrected TOST p < 0.05 within "
              "the margin (a tenth of b's distance below the bigram); \"null\": neither.", ""]
    lines += family_table(contrasts)
    lines += ["", *position_lines(results)]
    lines += ["## Figures", "", "Every seed's validation curve per cell, with the unigram and bigram references:",
              "", "![validation curves](val_curves.png)", ""]
    if contrasts:  # none before two seeds of a pair have finished
        lines += ["The contrasts' per-seed differences and their paired intervals:", "",
                  "![paired differences](paired_loss.png)", ""]
    lines += ["Final loss per domain against that domain's references:", "", "![per-domain loss](domains.png)"]
    out.mkdir(parents=True, exist_ok=True)
    write_figures(results, refs, contrasts, out)
    doc = {"results": results, "references": refs, "gate": g, "lr_selection": lr_choice or None, "family": contrasts}
    write_text(out / "results.json", json.dumps(doc, indent=1))
    path = out / "report.md"
    write_text(path, "\n".join(lines) + "\n")
    return path
