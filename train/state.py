"""The train state (params, routing biases, optimizer state, step) created directly sharded on the mesh.

State is a plain dict of pytrees so jit, orbax and tests see the same thing:
  {"params": nnx.State of Params, "bias": nnx.State of RoutingBias, "opt": optax state, "step": int32}
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moe import Transformer
from moe.model import abstract_model, split_model
from moe.sharding import state_shardings


def state_shapes(mcfg, tx, mesh, build=Transformer):
    """(graphdef, init, abstract state, shardings): init(seed) builds the state, `abstract` is its shapes and
    dtypes (nothing allocated), `shardings` where each leaf goes on the mesh. init_state runs init; ahead-of-time
    compilation for another machine (benchmarks/gpu_compile.py) needs the shapes alone."""

    # The seed is an argument, not a constant baked into the program: every seed then runs the same compiled
    # init (the persistent compilation cache serves a study's later seeds).
    def init(seed_):
        graphdef, params, bias = split_model(build(mcfg, nnx.Rngs(jax.random.key(seed_))))
        return {"params": params, "bias": bias, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    graphdef = split_model(abstract_model(mcfg, build))[0]
    abstract = jax.eval_shape(init, jnp.asarray(0, jnp.uint32))
    shardings = state_shardings(abstract, mesh)  # ConfigError naming a parameter that does not split
    return graphdef, init, abstract, shardings


def init_state(mcfg, tx, seed: int, mesh, build=Transformer):
    """(graphdef, state, shardings): the state is initialized under jit straight into its shardings.
    build(mcfg, rngs): the model class (the 2x2 study also builds experiments.encdec.model.EncoderDecoder here)."""
    graphdef, init, _, shardings = state_shapes(mcfg, tx, mesh, build)
    return graphdef, jax.jit(init, out_shardings=shardings)(jnp.asarray(seed, jnp.uint32)), shardings


def abstract_state(state):
    """ShapeDtypeStructs with shardings: the target orbax restores into."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
