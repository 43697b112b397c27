"""Loss curves of a run, without TensorBoard: training and validation loss, and validation loss per domain.

    python -m analysis.loss_curves --workdir runs/default        # writes runs/default/loss_curves.png
    python -m analysis.loss_curves --workdir runs/default --out /tmp/loss.png

The figure is train/loss_plot.py's, the one the trainer redraws at every evaluation, with the unigram and
bigram references of the run's validation targets (train/references.py) when the run's data can be read; the last
validation loss is printed against them.
"""

import json
import sys
from pathlib import Path

from plumbing.args import ArgParser
from plumbing.errors import ConfigError, UserError, exit_with, os_error
from rundir import RunDir
from rundir.metrics import read_rows


def main(argv=None):
    p = ArgParser(prog="python -m analysis.loss_curves", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="run directory with metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG to write (default: WORKDIR/loss_curves.png)")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
        # The plotting and the references: loaded once the flags are read (--help answers at once).
        from train.loss_plot import plot_loss_curves, run_title, series
        from train.references import gap_line

        metrics = RunDir(Path(args.workdir)).metrics
        if not metrics.is_file():
            raise UserError(f"no metrics.jsonl in {args.workdir}; pass the --workdir of a run "
                            "(python -m train writes it every log.every steps)")
        rows = read_rows(metrics)
        out = Path(args.out) if args.out else Path(args.workdir) / "loss_curves.png"
        if out.is_dir():
            raise UserError(f"--out {out} is a directory; pass the path of the PNG to write")
        if out.suffix.lower() not in (".png", ".pdf", ".svg"):
            raise UserError(f"--out {out} must end in .png, .pdf or .svg (the figure's format)")
        out.parent.mkdir(parents=True, exist_ok=True)
        refs, note = run_references(Path(args.workdir))
        plot_loss_curves(rows, out, title=run_title(args.workdir, rows), references=refs)
    except UserError as e:
        exit_with(e)
    except OSError as e:
        exit_with(os_error(e))
    val_S, val_N = series(rows, "val/loss")
    print(f"wrote {out} ({len(series(rows, 'loss')[0])} training rows, {len(val_S)} evaluations)")
    if len(val_N):
        last = float(val_N[-1])
        print(f"step {int(val_S[-1])}: " + (f"val loss {last:.4f} ({note})" if note else gap_line(last, refs)))
    return out


def run_references(workdir: Path) -> tuple[dict | None, str]:
    """(references, "") for the run's config.json, or (None, why) when its data cannot be read here."""
    from rundir.config_layout import up_to_date
    from rundir.run_config import RunConfig
    from train.references import references

    try:
        saved = up_to_date(json.loads(RunDir(workdir).config.read_text(encoding="utf-8")))
        return references(RunConfig.parse(saved)), ""
    except (OSError, ValueError, KeyError, TypeError, UserError, ConfigError) as e:
        return None, f"no n-gram references: {type(e).__name__}: {' '.join(str(e).split())[:100]}"


if __name__ == "__main__":
    main()
