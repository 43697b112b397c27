"""Generate text: `python -m train.generate (--workdir DIR [--step N] | --export EXPORT_DIR) --prompt TEXT
[--max_new_tokens N] [--temperature T] [--top_p P] [--seed S]`.

KV-cache decoding (moe/decode.py); temperature 0 is greedy. --export takes a directory written by
`python -m train.export` in any format (hf, safetensors, orbax); the run's tokenizer is the one in it. Prints the
prompt and its continuation, which stops before the first <|endoftext|>. Bad input: one line, exit 2.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from train.errors import UserError, exit_with


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(f"{message} (see `python -m {self.prog} --help`)")


def parse_args(argv):
    p = _Parser(prog="train.generate", description="Sample from a trained run or an export.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="run directory with checkpoints/")
    src.add_argument("--export", help="directory written by python -m train.export (hf, safetensors or orbax)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step with --workdir (default: newest)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.step is not None and args.export:
        raise UserError("--step applies to --workdir only; an export holds one step")
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1], got {args.top_p}")
    return args


def export_format(path: Path) -> str:
    """"hf", "safetensors" or "orbax", from the files an export directory holds."""
    from train.export import ORBAX_DIR

    if (path / "config.json").is_file():
        return "hf"
    if (path / "moe_config.json").is_file() and (path / "model.safetensors").is_file():
        return "safetensors"
    if (path / "moe_config.json").is_file() and (path / ORBAX_DIR).is_dir():
        return "orbax"
    raise UserError(f"--export {path}: not an export directory (no config.json, or moe_config.json with "
                    "model.safetensors or params/); write one with `python -m train.export`")


def load_export(path):
    """(model, tokenizer) from an export directory of any format."""
    from train.data.tokenizer import load_tokenizer

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--export {path} does not exist; write it with `python -m train.export`")
    fmt = export_format(path)
    try:
        if fmt == "hf":
            from train.hf_import import load_hf_checkpoint

            model = load_hf_checkpoint(str(path))
        elif fmt == "safetensors":
            from moe.safetensors_io import load_safetensors

            model = load_safetensors(str(path))
        else:
            from train.export import load_orbax_export

            model = load_orbax_export(path)
    except ValueError as e:  # HFImportError, safetensors_io's and ModelConfig's errors: a bad export directory
        raise UserError(f"--export {path}: {e}") from None
    return model, load_tokenizer(path / "tokenizer.json")


def load_run(workdir, step=None):
    """(model, tokenizer) from a training run's checkpoint."""
    from train.checkpoint import dump_tokenizer, load_model
    from train.data.tokenizer import load_tokenizer

    model, meta = load_model(workdir, step)
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(dump_tokenizer(meta, Path(tmp) / "tokenizer.json"))
    return model, tok


def for_inference(model):
    """The same weights with dropless dispatch: capacity / expert_parallel dispatch may drop token copies (a
    training-time bound); generation, like the HF export, routes every token to its experts."""
    if model.cfg.dispatch in ("dropless", "reference"):
        return model
    from flax import nnx

    from moe.model import Transformer

    cfg = model.cfg.replace(dispatch="dropless")
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))[0]
    return nnx.merge(graphdef, nnx.split(model)[1])


def continue_ids(model, prompt_ids, *, max_new_tokens=64, temperature=0.0, top_p=1.0, seed=0) -> list[int]:
    """New token ids after `prompt_ids`, cut before the first EOS (which is not returned)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moe.decode import generate
    from train.data.tokenizer import EOS_ID

    new = generate(for_inference(model), jnp.asarray([prompt_ids], jnp.int32), jax.random.key(seed),
                   max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p))
    new = np.asarray(new)[0].tolist()
    return new[:new.index(EOS_ID)] if EOS_ID in new else new


def main(argv=None) -> list[int]:
    """Prints prompt + continuation; returns the continuation's token ids (for tests)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        model, tok = load_export(args.export) if args.export else load_run(args.workdir, args.step)
        prompt_ids = tok.encode(args.prompt).ids
        if not prompt_ids:
            raise UserError("--prompt is empty after tokenization; give at least one character")
        new = continue_ids(model, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, seed=args.seed)
    except UserError as e:
        exit_with(e)
    print(tok.decode(prompt_ids + new, skip_special_tokens=False))
    return new


if __name__ == "__main__":
    main()
