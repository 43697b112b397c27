"""Export a trained run: `python -m train.export --workdir DIR --out EXPORT_DIR [--step N]
[--dtype float32|bfloat16] [--format hf|safetensors|orbax] [--mtp keep|drop] [--overwrite]`.

  hf           HuggingFace (config.json, safetensors, tokenizer, model card), exact logits, in the architecture the
               model is: Glm4MoeForCausalLM (grouped-query attention) or DeepseekV3ForCausalLM (model.attention=mla)
  safetensors  our lossless format (moe/hf/safetensors_io.py) + tokenizer.json: any config (prefix mask, NoPE ...)
  orbax        params + routing biases (no optimizer state) + moe_config.json + tokenizer.json, for JAX users:
               `model = train.export_dir.load_orbax_export(EXPORT_DIR)`

A model with multi-token prediction (model.mtp_depth) keeps its MTP modules in every format. In hf, --mtp keep
writes them as DeepSeek-V3 stores them (layer n_layers + k, num_nextn_predict_layers; what vLLM and SGLang read
for speculative decoding; transformers loads the rest and lists them as unexpected keys); --mtp drop writes the
plain HF model alone.

The export is written into a temporary directory next to --out and renamed into place at the end: a failure
never leaves a half export or touches an existing one. Bad input prints one line on stderr and exits 2.
"""

import argparse
import json
import sys

from plumbing.args import ArgParser
from plumbing.errors import ConfigError, UserError, exit_with, hide_orbax_tracebacks, os_error, storage_full

FORMATS = ("hf", "safetensors", "orbax")
DTYPES = ("float32", "bfloat16")


def parse_args(argv):
    p = ArgParser(prog="python -m train.export", description="Export a trained run (HF, safetensors or orbax).",
                  formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="examples:\n  python -m train.export --workdir runs/default --out exports/default\n"
                         "  python -m train.export --workdir runs/default --out exports/default_bf16 --dtype bfloat16 "
                         "--mtp drop\n  python -m train.export --workdir runs/default --out exports/default_st "
                         "--format safetensors\nfiles and formats: docs/export.md")
    p.add_argument("--workdir", required=True, help="run directory with checkpoints/")
    p.add_argument("--out", required=True, help="export directory (must not exist or be empty, see --overwrite)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights dtype for --format hf (default: "
                                                                      "float32; safetensors and orbax are float32)")
    p.add_argument("--format", default="hf", choices=FORMATS, help="hf: HuggingFace, exact logits; safetensors: our "
                                                                   "lossless format, any config; orbax: for JAX "
                                                                   "users (default: hf)")
    p.add_argument("--mtp", default="keep", choices=("keep", "drop"),
                   help="--format hf: keep the MTP modules as DeepSeek-V3 stores them (what vLLM and SGLang read; "
                        "transformers lists them as unexpected keys) or drop them for a plain HF model (default: keep)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous export in --out (never anything else)")
    args = p.parse_args(argv)
    if args.dtype != "float32" and args.format != "hf":
        raise UserError(f"--dtype {args.dtype} applies to --format hf only; {args.format} exports are lossless "
                        "float32")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    hide_orbax_tracebacks()
    try:
        args = parse_args(argv)  # --help and bad flags: answered before JAX and orbax load
        from train.export_dir import ExportError, export

        try:
            out = export(args.workdir, args.out, args.step, args.dtype, args.format, args.overwrite,
                         args.mtp == "keep")
        except (ExportError, ConfigError) as e:
            raise UserError(str(e)) from None
        except OSError as e:
            raise os_error(e) from None
        except Exception as e:
            full = storage_full(e)
            if full:
                raise UserError(f"{full[0]} while writing the export to {args.out}; nothing was replaced, "
                                f"{full[1]} and run the export again") from None
            raise
    except UserError as e:
        exit_with(e)
    except KeyboardInterrupt:
        exit_with(UserError(f"interrupted (Ctrl-C); --out {args.out} was not replaced (the next export into it "
                            "removes the unfinished one)"), 130)
    kind = args.format
    if args.format == "hf":  # the architecture picked from the model (moe.hf.write.architecture)
        kind = f"hf {json.loads((out / 'config.json').read_text())['architectures'][0]}"
    print(f"exported {args.workdir} ({kind}, {args.dtype}) to {out}")
    if args.format == "hf" and args.mtp == "keep" and (out / "config.json").is_file() and \
            json.loads((out / "config.json").read_text()).get("num_nextn_predict_layers"):
        print("note: the MTP modules were kept (--mtp keep): transformers loads the model and lists their tensors as "
              "unexpected keys; --mtp drop writes a plain HF model", file=sys.stderr)


if __name__ == "__main__":
    main()
