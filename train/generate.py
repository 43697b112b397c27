"""Generate text: `python -m train.generate (--workdir DIR [--step N] | --export EXPORT_DIR) --prompt TEXT
[--max_new_tokens N] [--temperature T] [--top_p P] [--seed S] [--speculative mtp]`.

KV-cache decoding (moe/decoding/generate.py); temperature 0 is greedy. --export takes a directory written by
`python -m train.export` in any format (hf, safetensors, orbax); the run's tokenizer is the one in it. Prints the
prompt and its continuation, which stops before the first <|endoftext|>. Bad input: one line, exit 2.

--speculative mtp (greedy, a model with multi-token prediction): the MTP module drafts one token and the main model
verifies it with the next (moe/decoding/speculative.py); prints the drafts' acceptance rate and tokens/s against plain
greedy decoding of the same prompt, whose output it checks is identical.
"""

import argparse
import math
import sys

from plumbing.args import ArgParser
from plumbing.errors import UserError, exit_with, os_error, out_of_memory


def parse_args(argv):
    p = ArgParser(prog="python -m train.generate",
                  description="Sample from a trained run or an export (KV-cache decoding; greedy by default).",
                  formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="examples:\n  python -m train.generate --workdir runs/default --prompt \"In the beginning\"\n"
                         "  python -m train.generate --export exports/default --prompt \"Once upon a time\" "
                         "--temperature 0.8 --top_p 0.95 --max_new_tokens 100\n"
                         "  python -m train.generate --workdir runs/deepseek_mini --prompt \"The\" --speculative mtp")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="run directory with checkpoints/")
    src.add_argument("--export", help="directory written by python -m train.export (hf, safetensors or orbax), or "
                                      "a HuggingFace model directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step with --workdir (default: the newest)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max_new_tokens", type=int, default=64, help="tokens to generate (default: 64; stops early "
                                                                  "at <|endoftext|>)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default: 0, greedy decoding)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1, off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--speculative", default="", choices=("", "mtp"),
                   help="mtp: draft with the model's MTP module, verify greedily, and report acceptance and speed "
                        "against plain greedy decoding (docs/mtp.md says when it pays)")
    args = p.parse_args(argv)
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


def main(argv=None) -> list[int]:
    """Prints prompt + continuation; returns the continuation's token ids (for tests)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)  # --help and bad flags: answered before JAX loads
    except UserError as e:
        exit_with(e)
    # The one boundary: JAX, the model and the readers load from here on.
    from rundir import open_run
    from train.export_dir import export_trained_len, load_export
    from train.generation import Interrupted, check_cache_fits, check_decodable, continue_ids, speculative_ids

    try:
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


if __name__ == "__main__":
    main()
