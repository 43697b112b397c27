"""Generate text: `python -m train.generate (--workdir DIR [--step N] | --export EXPORT_DIR) --prompt TEXT
[--max_new_tokens N] [--temperature T] [--top_p P] [--seed S] [--speculative mtp]`.

KV-cache decoding (moe/decoding/generate.py); temperature 0 is greedy. --export takes a directory written by
`python -m train.export` in any format (hf, safetensors, orbax); the run's tokenizer is the one in it. Prints the
prompt and its continuation, which stops before the first <|endoftext|>. Bad input: one line, exit 2.

--speculative mtp (greedy, a model with multi-token prediction): the MTP module drafts one token and the main model
verifies it with the next (moe/decoding/speculative.py); prints the drafts' acceptance rate and tokens/s against plain
greedy decoding of the same prompt, whose output it checks is identical.
"""

import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moe import Execution
from moe.accounting import kv_cache_bytes_per_token
from moe.decoding.generate import check_decodable as decodable
from moe.decoding.generate import generate, generate_chunks
from moe.decoding.speculative import speculative_generate
from moe.hf import load_model
from moe.hf.paths import OutsideDirectoryError, file_inside, tree_inside
from moe.hf.safetensors_io import load_safetensors
from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with, os_error, out_of_memory
from rundir import open_run
from train.data.tokenizer import EOS_ID, load_tokenizer
from train.export import EXPORT_MARKER, ORBAX_DIR, load_orbax_export
from train.preflight import device_memory_bytes

# How generation runs, whatever the run trained with: fp32 and dropless (KV-cache decoding steps one token at a
# time, and a dropping dispatch would make a row's continuation depend on the rest of the batch).
GENERATION = Execution()


def parse_args(argv):
    p = ArgParser(prog="python -m train.generate",
                  description="Sample from a trained run or an export (KV-cache decoding; greedy by default).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="run directory with checkpoints/")
    src.add_argument("--export", help="directory written by python -m train.export (hf, safetensors or orbax)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step with --workdir (default: newest)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (the default) is greedy decoding")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative", default="", help="mtp: draft with the model's MTP module, verify greedily, and "
                                                     "report acceptance and speed against plain greedy decoding")
    args = p.parse_args(argv)
    if args.speculative not in ("", "mtp"):
        raise UserError(f"--speculative {args.speculative!r} is not supported; use mtp (or leave it out)")
    if args.speculative and args.temperature != 0.0:
        raise UserError("--speculative mtp verifies greedily: leave --temperature at 0")
    try:
        args.prompt.encode("utf-8")  # undecodable bytes in argv arrive as lone surrogates
    except UnicodeEncodeError:
        raise UserError("--prompt is not valid UTF-8 text; pass the prompt in UTF-8") from None
    if args.step is not None and args.export:
        raise UserError("--step applies to --workdir only; an export holds one step")
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UserError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1], got {args.top_p}")
    return args


def export_format(path: Path) -> str:
    """"hf", "safetensors" or "orbax", from the files an export directory holds."""
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
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--export {path} does not exist; write it with `python -m train.export`")
    if (path / "moe-run.json").is_file() or (path / "checkpoints").is_dir():
        raise UserError(f"--export {path} is a training run, not an export; pass it as --workdir {path}")
    fmt = export_format(path)
    try:  # the weights of an HF or safetensors export are checked by their loaders
        file_inside(path, "tokenizer.json", "file")
        if fmt == "orbax":  # orbax and tensorstore walk params/: every entry below it must stay inside too
            tree_inside(path, ORBAX_DIR, "file")
    except OutsideDirectoryError as e:
        raise UserError(f"--export {path}: {e}") from None
    try:
        if fmt == "hf":
            model = load_model(str(path))
        elif fmt == "safetensors":
            model = load_safetensors(str(path))
        else:
            model = load_orbax_export(path)
    except (UserError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - HFImportError, a truncated safetensors file, a bad orbax export
        reason = " ".join(str(e).split())
        if (path / EXPORT_MARKER).is_file():  # one of ours: writing it again is the fix
            raise UserError(f"--export {path} is unreadable ({type(e).__name__}: {reason}); write it again with "
                            "`python -m train.export`") from None
        raise UserError(f"--export {path}: {reason}") from None  # a third party's model: the loader names the fix
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"--export {path} has no tokenizer.json; write it again with `python -m train.export`")
    return model, load_tokenizer(path / "tokenizer.json")


def export_trained_len(path) -> int | None:
    """The sequence length an HF export was trained on (its max_position_embeddings); None for other formats."""
    try:
        return int(json.loads((Path(path) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_cache_fits(model, total_tokens: int) -> None:
    """The KV cache holds every layer's keys and values (or MLA's latents) for every slot: refuse one that cannot
    fit."""
    need = kv_cache_bytes_per_token(model.cfg, GENERATION.dtype) * total_tokens
    have = device_memory_bytes(jax.devices()[0])
    if have is not None and need > have:
        raise UserError(f"a KV cache for {total_tokens:,} tokens needs {need / 2**30:.1f} GiB but the device has "
                        f"{have / 2**30:.1f} GiB; lower --max_new_tokens")


def check_decodable(model) -> None:
    """KV-cache decoding appends one token at a time, which only a causal or prefix-style mask allows."""
    try:
        decodable(model)
    except ValueError as e:
        raise UserError(f"this model cannot generate: {e}") from None


def continue_ids(model, prompt_ids, *, max_new_tokens=64, temperature=0.0, top_p=1.0, seed=0) -> list[int]:
    """New token ids after `prompt_ids`, cut before the first EOS (which is not returned). Decoded a chunk at a time
    (one compiled call each), stopping early at EOS; Ctrl-C between chunks raises Interrupted with the tokens so far."""
    new = []
    chunks = generate_chunks(model, jnp.asarray([prompt_ids], jnp.int32), jax.random.key(seed),
                             max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
                             execution=GENERATION)
    try:
        for chunk in chunks:
            new += np.asarray(chunk)[0].tolist()
            if EOS_ID in new:
                break
    except KeyboardInterrupt:
        raise Interrupted(new[:new.index(EOS_ID)] if EOS_ID in new else new) from None
    return new[:new.index(EOS_ID)] if EOS_ID in new else new


class Interrupted(Exception):
    """Ctrl-C during generation, with the token ids generated before it."""

    def __init__(self, ids: list[int]):
        super().__init__(f"interrupted after {len(ids)} tokens")
        self.ids = ids


def main(argv=None) -> list[int]:
    """Prints prompt + continuation; returns the continuation's token ids (for tests)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        if args.export:
            (model, tok), trained_len = load_export(args.export), export_trained_len(args.export)
        else:
            run = open_run(args.workdir, args.step)
            model, tok, trained_len = run.model, run.tokenizer, int(run.config.data.seq_len)
        check_decodable(model)
        prompt_ids = tok.encode(args.prompt).ids
        if not prompt_ids:
            raise UserError("--prompt is empty after tokenization; give at least one character")
        total = len(prompt_ids) + args.max_new_tokens
        check_cache_fits(model, total)
        if trained_len and total > trained_len:
            print(f"warning: {total} tokens is past the {trained_len} this model was trained on; quality drops "
                  "beyond that", file=sys.stderr)
        if args.speculative:
            new, report = speculative_ids(model, prompt_ids, args.max_new_tokens)
        else:
            new = continue_ids(model, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_p=args.top_p, seed=args.seed)
    except Interrupted as e:
        print(tok.decode(prompt_ids + e.ids, skip_special_tokens=False))
        exit_with(UserError(f"interrupted (Ctrl-C) after {len(e.ids)} of {args.max_new_tokens} new tokens"), 130)
    except KeyboardInterrupt:
        exit_with(UserError("interrupted (Ctrl-C) before generating"), 130)
    except UserError as e:
        exit_with(e)
    except OSError as e:
        exit_with(os_error(e))
    except Exception as e:
        if out_of_memory(e):
            exit_with(UserError(f"out of memory while generating ({type(e).__name__}); lower --max_new_tokens"))
        raise
    print(tok.decode(prompt_ids + new, skip_special_tokens=False))
    if args.speculative:
        print(report, file=sys.stderr)
    return new


def _timed(f):
    """(result, seconds) of f's second call: the first compiles."""
    jax.block_until_ready(f())
    t0 = time.perf_counter()
    out = jax.block_until_ready(f())
    return out, time.perf_counter() - t0


def speculative_ids(model, prompt_ids, max_new_tokens: int) -> tuple[list[int], str]:
    """(new ids cut before the first EOS, a one-line report): greedy speculative decoding with the MTP draft, timed
    against plain greedy decoding of the same tokens, whose output must be identical."""
    if not model.cfg.mtp_depth:
        raise UserError("--speculative mtp needs a model trained with multi-token prediction (model.mtp_depth >= 1); "
                        "this one has none")
    if len(prompt_ids) < 2:
        raise UserError("--speculative mtp needs a prompt of at least 2 tokens")
    prompt = jnp.asarray([prompt_ids], jnp.int32)
    (spec, drafts, accepted), t_spec = _timed(lambda: speculative_generate(
        model, prompt, max_new_tokens=max_new_tokens, execution=GENERATION))
    plain, t_plain = _timed(lambda: generate(model, prompt, jax.random.key(0), max_new_tokens=max_new_tokens,
                                             temperature=0.0, execution=GENERATION))
    spec, plain = np.asarray(spec)[0].tolist(), np.asarray(plain)[0].tolist()
    if spec != plain:
        first = next(i for i, (a, b) in enumerate(zip(spec, plain)) if a != b)
        raise RuntimeError(f"speculative decoding diverged from greedy decoding at new token {first}")
    drafts, accepted = int(drafts), int(accepted)
    report = (f"speculative (mtp): {accepted} of {drafts} drafts accepted ({accepted / max(drafts, 1):.1%}), "
              f"{drafts} main-model calls for {max_new_tokens} tokens; {max_new_tokens / t_spec:,.0f} tokens/s vs "
              f"{max_new_tokens / t_plain:,.0f} plain greedy (x{t_plain / t_spec:.2f}); output identical")
    return (spec[:spec.index(EOS_ID)] if EOS_ID in spec else spec), report


if __name__ == "__main__":
    main()
