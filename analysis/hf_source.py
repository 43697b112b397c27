"""Where the model and the rows come from when the routing analysis runs on a HuggingFace MoE directory.

    python -m analysis.routing --hf path/to/Qwen1.5-MoE-A2.7B --text a.txt --text b.txt --out /tmp/routing
    python -m analysis.routing --hf path/to/OLMoE-1B-7B --out /tmp/routing      # the bundled corpus, re-tokenized

The model comes from moe.hf.load_hf_moe (exact: same logits and experts as transformers), in memory or imported
onto a device mesh, or is a moe.hf.stream.LayerStream that reads one block at a time when it does not fit
(analysis/hf_memory.py chooses; analysis/routing/streamed.py runs it); the tokenizer from the directory's
tokenizer.json. Rows: each --text file is one domain named after the file (its whole text one
document), or, without --text, every domain of the bundled corpus's --split tokenized with the model's tokenizer
(cached like training's token caches, keyed by the tokenizer file's hash). Packed LM rows of --seq_len tokens.
"""

import dataclasses
from pathlib import Path

import numpy as np

from moe.hf import load_hf_moe, load_tokenizer
from moe.hf.common import read_config
from moe.hf.load import check_vocabulary
from plumbing.errors import UserError
from rundir.run_config import DataConfig, EvalConfig, RunConfig
from train.data import packing, tfds_corpus

EOS_NAMES = ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>", "<|end_of_text|>")


@dataclasses.dataclass
class HFRun:
    """The parts of rundir.Run that analysis.routing.collect uses, for a HF directory (no run, no step)."""

    workdir: Path
    model: object  # moe.Transformer
    tokenizer: object  # tokenizers.Tokenizer
    config: RunConfig  # what the analysis reads of it: data.seq_len / task / eval_split, eval.batch_size
    step: int | None = None

    @property
    def moe_layer_ids(self) -> list[int]:
        cfg = self.model.cfg
        return [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]


@dataclasses.dataclass
class HFSource:
    run: HFRun
    cache: packing.TokenCache
    split: str  # what the rows are, for messages and routing.json: "text" or the corpus split
    model_type: str  # config.json's


def open_model(path_dir, mesh=None) -> tuple:
    """(model, tokenizer) or UserError: analysing needs the directory's tokenizer.json. With a mesh, the model is
    imported straight into its shards (moe/hf/sharded.py)."""
    return _opened(path_dir, lambda path: load_hf_moe(path, mesh=mesh))


def open_stream(path_dir) -> tuple:
    """(moe.hf.stream.LayerStream, tokenizer) or UserError: every check of the import, no tensor read."""
    from moe.hf.stream import LayerStream

    def stream_and_tokenizer(path):
        stream, tokenizer = LayerStream(path), load_tokenizer(path)
        if tokenizer is not None:
            check_vocabulary(tokenizer, stream.cfg.vocab_size, str(Path(path) / "tokenizer.json"))
        return stream, tokenizer

    return _opened(path_dir, stream_and_tokenizer)


def _opened(path_dir, load) -> tuple:
    path = Path(path_dir)
    if not path.is_dir():
        raise UserError(f"--hf {path} is not a directory; pass a HuggingFace model directory (config.json, "
                        "*.safetensors, tokenizer.json)")
    try:
        model, tokenizer = load(str(path))
    except ValueError as e:  # HFImportError, or a tensor of the wrong shape (one line, naming it)
        raise UserError(str(e)) from None
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a truncated safetensors file
        raise UserError(f"--hf {path}: unreadable checkpoint ({type(e).__name__}: {str(e)[:100]})") from None
    if tokenizer is None:
        raise UserError(f"--hf {path}: no tokenizer.json; the analysis needs the model's tokenizer "
                        "(save it with tokenizer.save_pretrained(DIR))")
    if tokenizer.get_vocab_size(with_added_tokens=True) > model.cfg.vocab_size:
        raise UserError(f"--hf {path}: tokenizer.json has {tokenizer.get_vocab_size(with_added_tokens=True)} "
                        f"tokens, more than the model's vocab_size {model.cfg.vocab_size}")
    return model, tokenizer


def special_ids(c: dict, tokenizer, path_dir) -> tuple[int, int]:
    """(eos, pad) ids: config.json's eos_token_id (the first of a list), else a usual EOS token of the tokenizer;
    pad_token_id, else eos (packed LM rows never pad inside a row)."""
    eos = c.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None:
        eos = next((tokenizer.token_to_id(t) for t in EOS_NAMES if tokenizer.token_to_id(t) is not None), None)
    if eos is None:
        raise UserError(f"--hf {path_dir}: config.json has no eos_token_id and the tokenizer none of "
                        f"{', '.join(EOS_NAMES)}; set eos_token_id in config.json")
    pad = c.get("pad_token_id")
    return int(eos), int(eos if pad is None else pad)


def text_cache(paths, tokenizer, eos_id: int, pad_id: int) -> packing.TokenCache:
    """One domain per file, named after it (file stem; the full path when two stems collide)."""
    stems = [Path(p).stem for p in paths]
    names = [str(p) if stems.count(s) > 1 else s for p, s in zip(paths, stems)]
    tokenizer.encode_special_tokens = True  # text that spells "<|endoftext|>" stays text, as in training caches
    docs = []
    for p in paths:
        if Path(p).exists() and not Path(p).is_file():  # a directory, a device (/dev/zero) or a pipe
            raise UserError(f"--text {p}: not a regular file; pass a UTF-8 text file")
        try:
            text = Path(p).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"--text {p}: no such file") from None
        except UnicodeDecodeError as e:
            raise UserError(f"--text {p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise UserError(f"--text {p}: no tokens (empty file?)")
        docs.append(np.asarray(ids, np.uint32))
    offsets = np.zeros(len(docs) + 1, np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return packing.TokenCache(np.concatenate(docs), offsets, np.arange(len(docs), dtype=np.int32), tuple(names),
                              eos_id, pad_id)


def corpus_cache(path_dir, split: str, tokenizer, eos_id: int, pad_id: int) -> packing.TokenCache:
    """The bundled corpus's `split` in the model's tokenizer (tokenized once, then read from the token cache)."""
    src = tfds_corpus.load_source("moe_corpus", split)
    return packing.token_cache_with(src, tokenizer, Path(path_dir) / "tokenizer.json", eos_id=eos_id, pad_id=pad_id)


def open_source(path_dir, texts=None, split=None, seq_len=256, batch_size=16, opened=None) -> HFSource:
    """The rows and what routes them: `opened` (model, tokenizer) from open_model / open_stream, default the
    in-memory model."""
    model, tokenizer = opened or open_model(path_dir)
    c, _ = read_config(str(path_dir))
    eos, pad = special_ids(c, tokenizer, path_dir)
    if texts:
        cache, split = text_cache(texts, tokenizer, eos, pad), "text"
    else:
        split = split or "validation"
        cache = corpus_cache(path_dir, split, tokenizer, eos, pad)
    config = RunConfig(model=model.cfg, data=DataConfig(seq_len=seq_len, task="lm", eval_split=split),
                       eval=EvalConfig(batch_size=batch_size))
    return HFSource(HFRun(Path(path_dir), model, tokenizer, config), cache, split, c["model_type"])
