"""The routing analysis of a HuggingFace checkpoint larger than memory: one layer's weights at a time, every row
through that layer, then the next (moe/hf/stream.py); chosen by `analysis.routing --hf` when the model does not fit
(analysis/hf_memory.py).

    python -m analysis.routing --hf DIR --out OUT --memory_gb 20      # streamed when the fp32 model needs more

Rows are `collect.analyse`'s batches; the hidden states of all of them stay in memory (fp32, [batches, B, L, D]).
Each block's routing (expert ids, gates, scores) and the hidden states after it are written to OUT/stream/ as the
block finishes (each file written whole, then renamed into place; state.json last), so a stopped analysis resumes
after its last finished block: it must be the same checkpoint (the safetensors headers' hash), the same rows (a
hash of every batch) and the same flags, or it is refused in one line. After the last block the final norm and head
give every token's next-token loss (the logits are never all in memory: moe.lm_loss.cross_entropy, in chunks);
then the stored routing is counted exactly as the in-memory analysis counts it (accumulate.py), so the outputs are
the same files with the same numbers (tests/test_routing_streamed.py).
"""

import functools
import gc
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from analysis.routing import accumulate
from moe.hf import stream as layers
from moe.lm_loss import cross_entropy
from moe.model import DEFAULT_EXECUTION
from plumbing.errors import UserError

FORMAT = 1


class Store:
    """OUT/stream/: state.json ({"key": what was analysed, "done": stages finished}), hidden_S.npy (the rows' hidden
    states after stage S), layer_I.npz (MoE layer I's routing), token_loss.npy. Stage 0 embeds, stage i + 1 runs
    block i, stage n_layers + 1 the head. Files are complete or absent: each is written under a temporary name and
    renamed, and state.json is renamed last, so it never names a stage whose files are not all there."""

    def __init__(self, path: Path, key: dict):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        state = json.loads((path / "state.json").read_text()) if (path / "state.json").is_file() else None
        if state is not None and state.get("key") != key:
            raise UserError(f"{path} holds a streamed analysis of {_difference(state.get('key') or {}, key)}; "
                            f"delete {path} (or pass another --out) to start over")
        self.key, self.done = key, (state or {}).get("done", 0)

    def _write(self, name: str, save) -> None:
        tmp = self.path / (name + ".tmp")
        with open(tmp, "wb") as f:
            save(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)

    def finish(self, stage: int, hidden=None, **arrays) -> None:
        """Stage done: its outputs written, then the state; the hidden states before it removed."""
        for name, value in arrays.items():
            self._write(name, lambda f, v=value: np.savez(f, **v) if isinstance(v, dict) else np.save(f, v))
        if hidden is not None:
            self._write(f"hidden_{stage + 1}.npy", lambda f: np.save(f, hidden))
        self._write("state.json", lambda f: f.write(json.dumps({"key": self.key, "done": stage + 1}).encode()))
        self.done = stage + 1
        (self.path / f"hidden_{stage}.npy").unlink(missing_ok=True)

    def hidden(self) -> np.ndarray:
        return np.load(self.path / f"hidden_{self.done}.npy")

    def routing(self, layer: int):
        with np.load(self.path / f"layer_{layer}.npz") as z:
            return z["expert_ids"], z["gates"]


def _difference(old: dict, new: dict) -> str:
    """What differs, in words: the first differing entry of the stored key and this run's."""
    for what, name in (("format", "another format"), ("checkpoint", "another checkpoint"),
                       ("tokens", "other rows (tokens, --text / --split, --max_tokens)")):
        if old.get(what) != new.get(what):
            return name
    was = old.get("flags", {})
    changed = [f"{k} {was.get(k)!r}, now {new['flags'].get(k)!r}" for k in sorted(set(was) | set(new["flags"]))
               if was.get(k) != new["flags"].get(k)]
    return f"other flags ({'; '.join(changed)})"


def _rows_hash(batches) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for k in sorted(batch):
            h.update(k.encode() + np.ascontiguousarray(batch[k]).tobytes())
    return h.hexdigest()[:32]


@functools.partial(jax.jit, static_argnums=(0, 4))
def _token_loss(graphdef, state, x_BxLxD, targets_BxL, chunks):
    """Next-token cross-entropy [B, L] from the last block's output: Transformer.token_losses' head."""
    ends = nnx.merge(graphdef, state)
    return cross_entropy(ends.final_norm(x_BxLxD), ends.head(), targets_BxL, chunks)


def analyse(src, out: Path, flags: dict, split, max_tokens, tokens, n_samples=2, n_frequent=20, progress=True,
            log=print):
    """(collect.Analysis, a dict of what the streaming took) for analysis.hf_source's HFSource whose model is a
    moe.hf.stream.LayerStream; resumes OUT/stream/ when it holds this analysis."""
    run, stream = src.run, src.run.model
    cfg, n = stream.cfg, stream.cfg.n_layers
    batches, domain_names = accumulate.rows(run, split, max_tokens, src.cache, n_samples)
    store = Store(Path(out) / "stream", {"format": FORMAT, "checkpoint": stream.files.fingerprint(),
                                         "tokens": _rows_hash(batches), "flags": flags})
    if store.done:
        log(f"resuming the streamed analysis in {store.path}: {min(store.done - 1, n)} of {n} layers done")
    ex = DEFAULT_EXECUTION.resolved()
    shell = layers.Ends(cfg, {})  # Transformer.block_inputs needs the config only

    def inputs(b):  # a batch's positions and mask, made when its rows run (a mask per batch would pile up)
        return shell.block_inputs(jnp.asarray(batches[b]["tokens"]), positions_BxL=jnp.asarray(batches[b]["positions"]),
                                  segment_ids_BxL=jnp.asarray(batches[b]["segment_ids"]))

    n_tokens = int(sum(b["valid"].sum() for b in batches))
    stages = [("embed", ("embed",))] + [(f"blocks.{i}", ()) for i in range(n)] + [("head", stream.head_names())]
    todo = range(store.done, len(stages))
    total = sum(stream.disk_bytes(g if g.startswith("blocks") else "", ends) for g, ends in (stages[s] for s in todo))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="streamed analysis", disable=None if progress else True)
    start, read0, reading = time.perf_counter(), stream.files.bytes_read.total(), 0.0
    for s in todo:
        bar.set_description(f"layer {s}/{n}" if 0 < s <= n else stages[s][0])
        t = time.perf_counter()
        if s == 0:
            ends = stream.ends("embed")
            reading += time.perf_counter() - t
            bar.update(stream.disk_bytes(ends=("embed",)))
            store.finish(0, np.stack([np.asarray(layers.embed(ends, jnp.asarray(b["tokens"]), ex)) for b in batches]))
            del ends
        elif s <= n:
            hidden, block = store.hidden(), stream.block(s - 1, on_read=bar.update)
            reading += time.perf_counter() - t
            new, routed = np.empty_like(hidden), {"expert_ids": [], "gates": [], "scores": []}
            for b in range(len(batches)):  # the hidden states before and after the block: two copies at most
                out = layers.run_block(block, jnp.asarray(hidden[b]), inputs(b), ex)
                new[b] = np.asarray(out.x)
                if out.routing is not None:
                    for k, v in routed.items():
                        v.append(np.asarray(getattr(out.routing, k)))
                del out
            del block, hidden
            gc.collect()  # a Module's graph holds cycles: free its weights before the next block is read
            routing = {f"layer_{s - 1}.npz": {k: np.stack(v) for k, v in routed.items()}} if routed["gates"] else {}
            store.finish(s, new, **routing)
            del new, routing
            if progress and not sys.stderr.isatty():  # no bar in a log file: a line per layer
                log(_progress_line(s, n, stream.files.bytes_read.total() - read0, time.perf_counter() - start,
                                   total))
        else:
            ends = stream.ends(*stream.head_names())
            reading += time.perf_counter() - t
            bar.update(stream.disk_bytes(ends=stream.head_names()))
            graphdef, state = nnx.split(ends)
            hidden = store.hidden()
            loss = np.stack([np.asarray(_token_loss(graphdef, state, jnp.asarray(hidden[b]),
                                                    jnp.asarray(batches[b]["targets"]), ex.loss_chunks))
                             for b in range(len(batches))])
            store.finish(s, None, **{"token_loss.npy": loss})
            del ends, state, hidden
    bar.close()
    seconds, read = time.perf_counter() - start, stream.files.bytes_read.total() - read0
    routing = {i: store.routing(i) for i in run.moe_layer_ids}
    a = accumulate.accumulate(run, batches, domain_names,
                              lambda b: [(routing[i][0][b], routing[i][1][b]) for i in run.moe_layer_ids],
                              tokens=tokens, n_samples=n_samples, n_frequent=n_frequent, seconds=seconds)
    loss = np.load(store.path / "token_loss.npy")
    counted = np.stack([b["valid"] & (b["loss_mask"] > 0) for b in batches])
    info = {"mode": "stream", "layers": n, "layers_this_session": sum(1 for s in todo if 0 < s <= n),
            "tokens": n_tokens, "seconds": seconds, "seconds_per_1000_tokens": 1000 * seconds / max(n_tokens, 1),
            "read_seconds": reading, "bytes_read": read, "read_MB_per_s": read / 1e6 / max(reading, 1e-9),
            "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "mean_token_loss": float(loss[counted].mean()) if counted.any() else None}
    return a, info


def _progress_line(s: int, n: int, n_read: int, seconds: float, total_bytes: int) -> str:
    """One line per finished layer: bytes read, rate, and the time left at this session's rate (of the bytes still
    to read, `total_bytes` in all)."""
    left = seconds * max(total_bytes - n_read, 0) / max(n_read, 1)
    return (f"layer {s}/{n} done: read {n_read / 1e9:.2f} GB in {seconds:.0f} s ({n_read / 1e6 / max(seconds, 1e-9):.0f} "
            f"MB/s); about {left / 60:.1f} min left")


def report(info: dict) -> str:
    """The line printed at the end: time per 1,000 tokens, bytes read and their rate, peak memory."""
    loss = f"; mean next-token loss {info['mean_token_loss']:.3f}" if info["mean_token_loss"] is not None else ""
    return (f"streamed {info['layers_this_session']} of {info['layers']} layers over {info['tokens']:,} tokens in "
            f"{info['seconds']:.0f} s ({info['seconds_per_1000_tokens']:.1f} s per 1,000 tokens); read "
            f"{info['bytes_read'] / 1e9:.2f} GB in {info['read_seconds']:.0f} s ({info['read_MB_per_s']:.0f} MB/s); "
            f"peak memory {info['peak_memory_bytes'] / 1e9:.2f} GB{loss}")
