"""When speculative decoding with the MTP draft pays: the cost of one speculative step (the MTP block on 2 tokens,
then the main model on 2 tokens) in plain greedy steps, and so the draft acceptance rate above which it is faster.

    python -m benchmarks.speculative_cost [--preset cpu|gpu|tiny] [--prompt 64] [--new_tokens 128] [--steps 3]

A speculative step yields 1 + (the draft accepted) tokens, a plain step 1: speculative decoding is faster once the
acceptance rate exceeds (speculative step time / plain step time) - 1, the break-even. The models are randomly
initialized (configs/deepseek_mini.py's for cpu, configs/gpu_1b.py's with one MTP module for gpu): their drafts
are rarely accepted, so every speculative step is timed as one draft + one verification, which is what the
break-even needs; a trained model's acceptance is what `python -m train.generate --speculative mtp` prints.
"""

import argparse
import importlib

import jax
from flax import nnx

from benchmarks.common import describe, table, time_fns
from moe import Execution, ModelConfig, Transformer
from moe.decoding import generate, speculative_generate

MODELS = {"cpu": "configs.deepseek_mini", "gpu": "configs.gpu_1b", "tiny": "configs.tiny"}


def rows(preset: str, prompt: int, new_tokens: int, steps: int, dtype: str) -> list[dict]:
    fields = dict(importlib.import_module(MODELS[preset]).get_config().model)
    cfg = ModelConfig(**{**fields, "mtp_depth": max(1, fields["mtp_depth"])})
    model = Transformer(cfg, nnx.Rngs(0))
    ex = Execution(dtype=dtype)
    tokens = jax.random.randint(jax.random.key(1), (1, prompt), 0, cfg.vocab_size)
    plain = lambda: generate(model, tokens, jax.random.key(0), max_new_tokens=new_tokens, execution=ex)
    spec = lambda: speculative_generate(model, tokens, max_new_tokens=new_tokens, execution=ex)
    plain_s, spec_s = time_fns([(plain, ()), (spec, ())], steps)  # round-robin: load changes hit both alike
    _, drafts, accepted = spec()
    step_cost = (spec_s / int(drafts)) / (plain_s / new_tokens)
    return [{"model": MODELS[preset], "context": prompt, "new tokens": new_tokens,
             "plain ms/token": f"{1e3 * plain_s / new_tokens:.2f}",
             "speculative ms/step": f"{1e3 * spec_s / int(drafts):.2f}",
             "step cost (plain steps)": f"{step_cost:.2f}", "break-even acceptance": f"{step_cost - 1:.0%}",
             "drafts accepted (random init)": f"{int(accepted)}/{int(drafts)}"}]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative_cost", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu", choices=sorted(MODELS))
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    print(describe())
    print(table(rows(a.preset, a.prompt, a.new_tokens, a.steps, a.dtype)))


if __name__ == "__main__":
    main()
