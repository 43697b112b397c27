"""A tiny random HuggingFace MoE checkpoint with a tokenizer, to try `analysis.routing --hf` without a download.

    python -m analysis.tiny_hf --out /tmp/tiny_hf
    python -m analysis.routing --hf /tmp/tiny_hf --out /tmp/tiny_hf_routing

The model has configs/tiny.py's shape (1.15M parameters, 8 routed experts top-2 + 1 shared, group-limited
routing), random weights and random routing biases, written by `moe.hf.write_hf_checkpoint` as a `glm4_moe`
(Glm4MoeForCausalLM) directory with the bundled tokenizer: what transformers loads and what `moe.hf.load_hf_moe`
reads back exactly. A random model routes by noise: this shows the commands and their outputs, not a finding.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from configs.tiny import get_config
from moe import Transformer, set_routing_biases
from moe.hf import write_hf_checkpoint
from plumbing.args import ArgParser, check_out_dir, run_cli
from plumbing.errors import UserError
from train.data.tokenizer import DEFAULT_TOKENIZER
from train.preflight import parse


def tiny_model(seed: int = 0) -> Transformer:
    cfg = parse(get_config()).model
    model = Transformer(cfg, nnx.Rngs(seed))
    keys = jax.random.split(jax.random.key(seed + 1), cfg.n_layers)
    set_routing_biases(model, [0.01 * jax.random.normal(k, (cfg.n_routed_experts,), jnp.float32)
                               for k, layer in zip(keys, range(cfg.n_layers)) if cfg.is_moe_layer(layer)])
    return model


def write(out, seed: int = 0) -> list[str]:
    """The checkpoint's files, written into `out` (an empty or new directory)."""
    return write_hf_checkpoint(tiny_model(seed), str(out), str(DEFAULT_TOKENIZER), max_position_embeddings=256,
                               model_card={"description": "a tiny random MoE (moe-lm's analysis.tiny_hf)"})


def parse_args(argv):
    p = ArgParser(prog="python -m analysis.tiny_hf", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="a new or empty directory for the checkpoint")
    p.add_argument("--seed", type=int, default=0, help="weights and routing biases")
    return p.parse_args(argv)


def run(args, log=print):
    out = check_out_dir(args.out, None, create=False)
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty; choose a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    files = write(out, args.seed)
    log(f"wrote a tiny random glm4_moe checkpoint to {out} ({', '.join(files)})")
    log(f"next: python -m analysis.routing --hf {out} --out {out}_routing")
    return out


def main(argv=None):
    run_cli(run, parse_args, argv)


if __name__ == "__main__":
    main()
