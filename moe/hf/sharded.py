"""The HF import on a device mesh: every variable goes straight into its sharded array, and each process reads only
the slices of the checkpoint its own devices hold.

    model, tokenizer = load_hf_moe(DIR, mesh=moe.sharding.make_mesh(1, 1, 8, 1))   # experts over 8 devices

Shardings come from the variables' logical axes and the one rules table (moe/sharding.py: experts on `expert`,
heads and FFN widths on `tensor`, `embed` on `fsdp`), exactly as training places them. Each array is made by
`jax.make_array_from_callback`: for every addressable device the callback reads that device's slice of the
variable's HF tensors (moe.hf.pieces.Piece.read_slice: the byte ranges of the slice's rows, FP8 by whole tiles),
once per distinct slice however many local devices replicate it. No process ever holds a whole expert array or the
whole model: with the experts split n ways over the processes' devices, each reads about 1/n of the expert bytes
(`SafetensorsFiles.bytes_read`; tests/test_hf_sharded.py counts them).

Checks: every shape and name check of the import runs first, on every process, from the headers
(moe.hf.weights.plan). An MTP layer's copy of the embedding or head is compared with the main tensor slice by
slice, by the processes that read the slice. A tied head stored beside the embedding was compared whole before
(moe.hf.weights.untie_as_transformers, on every process).
"""

import dataclasses

import jax
import numpy as np
from flax import nnx

from moe.hf.common import HFImportError
from moe.hf.weights import held, plan
from moe.model import Transformer
from moe.sharding import RULES, state_shardings


def load_sharded(cfg, layout, files, where: str, mesh: jax.sharding.Mesh, rules=RULES) -> Transformer:
    """The model of `cfg` from `files` (moe.hf.tensors.SafetensorsFiles), every variable sharded on `mesh` by `rules`
    (ConfigError naming a variable whose dimension does not split evenly, before anything is read)."""
    steps = plan(cfg, layout, files.shapes, where)
    pieces = {k: p for step in steps for k, p in step.pieces.items()}
    copies = _copies(steps, pieces)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shardings = dict(nnx.to_flat_state(state_shardings(state, mesh, rules)))
    flat = list(nnx.to_flat_state(state))
    names = {".".join(map(str, path)) for path, _ in flat}
    missing, unexpected = sorted(names - set(pieces)), sorted(set(pieces) - names)
    if missing or unexpected:  # the plan and the model disagree: a bug here, not in the checkpoint
        raise ValueError(f"{where}: variables {missing[:3]} have no tensor, tensors for {unexpected[:3]} no variable")
    filled = []
    for path, var in flat:
        k = ".".join(map(str, path))
        read = _slice_reader(pieces[k], files, copies.get(k, ()), where)
        shape = var.get_value().shape
        filled.append((path, var.replace(jax.make_array_from_callback(shape, shardings[path].get_value(), read))))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def _slice_reader(piece, files, copies, where):
    """callback(index) -> this device's slice (fp32), read once per distinct slice (replicas share it); each copy
    (an MTP layer's embedding or head) must hold the same slice."""
    done = {}

    def read(index):
        key = tuple(s.indices(n)[:2] for s, n in zip(index, piece.shape))
        if key not in done:
            done[key] = held(piece.read_slice(files, index))
            for copy, main in copies:
                if not np.array_equal(held(dataclasses.replace(piece, names=(copy,)).read_slice(files, index)),
                                      done[key]):
                    raise HFImportError(f"{where}: tensor {copy!r} differs from {main!r}; our MTP modules share the "
                                        "main model's embedding and head (as DeepSeek-V3 trains them)")
        return done[key]

    return read


def _copies(steps, pieces) -> dict[str, list[tuple[str, str]]]:
    """Our variable -> the (MTP copy, main HF tensor) pairs whose values must equal its source: the embedding's and
    the head's copies (the head's copy checks against the embedding when they are tied)."""
    of = {}
    for step in steps:
        for copy, main in step.copies:
            k = "lm_head" if main == "lm_head.weight" and "lm_head" in pieces else "embed"
            of.setdefault(k, []).append((copy, main))
    return of
