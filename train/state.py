"""The train state (params, routing biases, optimizer state, step) created directly sharded on the mesh.

State is a plain dict of pytrees so jit, orbax and tests see the same thing:
  {"params": nnx.State of Params, "bias": nnx.State of RoutingBias, "opt": optax state, "step": int32}
"""

import jax
import jax.numpy as jnp
from flax import nnx

from moe import RoutingBias, Transformer
from moe.sharding import state_shardings


def split_model(model: Transformer):
    graphdef, params, bias = nnx.split(model, nnx.Param, RoutingBias)
    return graphdef, params, bias


def merge_model(graphdef, params, bias) -> Transformer:
    return nnx.merge(graphdef, params, bias)


def abstract_model(mcfg) -> Transformer:
    return nnx.eval_shape(lambda: Transformer(mcfg, nnx.Rngs(0)))


def init_state(mcfg, tx, seed: int, mesh):
    """(graphdef, state, shardings): the state is initialized under jit straight into its shardings."""

    def init():
        graphdef, params, bias = split_model(Transformer(mcfg, nnx.Rngs(seed)))
        return {"params": params, "bias": bias, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    graphdef = split_model(abstract_model(mcfg))[0]
    abstract = jax.eval_shape(init)
    shardings = state_shardings(abstract, mesh)
    return graphdef, jax.jit(init, out_shardings=shardings)(), shardings


def abstract_state(state):
    """ShapeDtypeStructs with shardings: the target orbax restores into."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
