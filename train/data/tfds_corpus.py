"""TFDS builder `moe_corpus` over a directory of `{domain}.jsonl.xz|.jsonl|.txt` files, read without TensorFlow.

    src = load_source("moe_corpus", "train", data_dir=None)   # prepares on first use (a few seconds)
    src[0]  # {"text": str, "domain": int}; src.domains lists the domain names

The data set is written as array_record and read back through `tfds.data_source`; `tfds.load` / `as_dataset` would
need TensorFlow, which this project does not install. The builder config name is a fingerprint of the corpus files,
so editing the corpus makes a fresh prepared copy instead of silently reading a stale one.
"""

import contextlib
import hashlib
import io
import json
import logging
import lzma
import math
import os
from pathlib import Path

import tensorflow_datasets as tfds

from plumbing.errors import UserError

DEFAULT_CORPUS_DIR = Path(__file__).parent / "corpus"
DEFAULT_DATA_DIR = os.environ.get("MOE_LM_TFDS_DIR", os.path.expanduser("~/.cache/moe-lm/tfds"))
SUFFIXES = (".jsonl.xz", ".jsonl", ".txt")
VAL_FRACTION, VAL_MIN_DOCS = 0.02, 20
# The per-corpus config is intentional; TFDS warns about every "custom data configuration".
logging.getLogger("absl").addFilter(lambda r: "custom data configuration" not in r.getMessage())


def corpus_files(corpus_dir) -> dict[str, Path]:
    """{domain: file} for the corpus directory, sorted by domain."""
    corpus_dir = Path(corpus_dir)
    if not corpus_dir.is_dir():
        raise UserError(f"corpus directory {corpus_dir} not found; pass corpus_dir= a folder of {{domain}}.jsonl files")
    files = {}
    for path in sorted(corpus_dir.iterdir()):
        suffix = next((s for s in SUFFIXES if path.name.endswith(s)), None)
        if suffix is None:
            continue
        domain = path.name[: -len(suffix)]
        if domain in files:
            raise UserError(f"domain {domain!r} has two files in {corpus_dir} ({files[domain].name}, {path.name}); keep one")
        files[domain] = path
    if not files:
        raise UserError(f"no {'/'.join(SUFFIXES)} files in {corpus_dir}; add one file per domain")
    return dict(sorted(files.items()))


def read_docs(path, text_field="text") -> list[str]:
    """Documents of one domain file: one JSON object per line (jsonl[.xz]) or blank-line separated text (txt)."""
    path = Path(path)
    try:
        raw = lzma.open(path).read() if path.name.endswith(".xz") else path.read_bytes()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 (byte {e.start}); re-encode it, e.g. iconv -f latin1 -t utf-8") from e
    except (OSError, lzma.LZMAError) as e:
        raise UserError(f"cannot read {path}: {e}; check the file or rebuild the corpus") from e
    if path.name.endswith(".txt"):
        docs = [d.strip() for d in text.replace("\r\n", "\n").split("\n\n")]
    else:
        docs = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                docs.append(json.loads(line)[text_field])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"{path} line {i + 1}: expected a JSON object with a {text_field!r} field") from e
    docs = [d for d in docs if d and d.strip()]
    if not docs:
        raise UserError(f"{path} holds no documents; fill it or remove the file")
    return docs


def fingerprint(corpus_dir) -> str:
    """Short hash of the corpus files' names and bytes: changes whenever the corpus does."""
    h = hashlib.sha256()
    for domain, path in corpus_files(corpus_dir).items():
        h.update(f"{domain}\0{path.name}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def validation_ids(docs: list[str]) -> set[int]:
    """Indices of the held-out documents: the ~2% (>= 20, <= 1/5 of the domain) with the smallest content hash.

    Choosing by hash keeps a document's split stable when other documents are added or reordered.
    """
    n_val = min(max(VAL_MIN_DOCS, math.ceil(VAL_FRACTION * len(docs))), len(docs) // 5)
    n_val = max(n_val, 1 if len(docs) >= 2 else 0)
    ranked = sorted(range(len(docs)), key=lambda i: (hashlib.sha1(docs[i].encode()).hexdigest(), i))
    return set(ranked[:n_val])


class MoeCorpus(tfds.core.GeneratorBasedBuilder):
    """Multi-domain text corpus: features {"text", "domain"}, splits train / validation."""

    name = "moe_corpus"
    VERSION = tfds.core.Version("1.0.0")
    # No checksums file to look up: the base class would find it via importlib_resources, an optional
    # dependency that is not installed here.
    code_path = None

    def __init__(self, *, corpus_dir=DEFAULT_CORPUS_DIR, **kwargs):
        self._corpus_dir = Path(corpus_dir)
        self._files = corpus_files(self._corpus_dir)
        kwargs.setdefault("config", tfds.core.BuilderConfig(name=fingerprint(self._corpus_dir)))
        super().__init__(**kwargs)

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"Multi-domain corpus from {self._corpus_dir}",
            features=tfds.features.FeaturesDict({
                "text": tfds.features.Text(),
                "domain": tfds.features.ClassLabel(names=list(self._files)),
            }),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # everything is local
        return {"train": self._generate_examples("train"), "validation": self._generate_examples("validation")}

    def _generate_examples(self, split):
        for domain, path in self._files.items():
            docs = read_docs(path)
            val = validation_ids(docs)
            for i, doc in enumerate(docs):
                if (i in val) == (split == "validation"):
                    yield f"{domain}-{i:07d}", {"text": doc, "domain": domain}


class TextSource:
    """Random-access view of a TFDS data source as {"text": str, "domain": int} dicts (picklable for grain)."""

    def __init__(self, src, key: str, domains: list[str], text_field="text", domain_field="domain"):
        self._src, self.key, self.domains = src, key, domains
        self._text_field, self._domain_field = text_field, domain_field

    def __len__(self):
        return len(self._src)

    def __getitem__(self, i):
        ex = self._src[i]
        text = ex[self._text_field]
        text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        return {"text": text, "domain": int(ex.get(self._domain_field, 0)) if self.domains else 0}


def prepare(data_dir=None, corpus_dir=None) -> MoeCorpus:
    """The `moe_corpus` builder, prepared into data_dir (a no-op when this exact corpus is already there)."""
    builder = MoeCorpus(corpus_dir=corpus_dir or DEFAULT_CORPUS_DIR, data_dir=data_dir or DEFAULT_DATA_DIR,
                        file_format="array_record")
    tfds.disable_progress_bar()  # TFDS's bars would break the one-line error contract of the CLIs
    if not (Path(builder.data_dir) / "dataset_info.json").is_file():  # TFDS's is_prepared() warns when it is not
        print(f"preparing the bundled corpus in {builder.data_dir} (once; later runs read it from there)")
    # TFDS prints "Downloading and preparing dataset Unknown size ..." to stdout: nothing is downloaded here.
    with contextlib.redirect_stdout(io.StringIO()):
        builder.download_and_prepare()
    return builder


def load_source(name: str, split: str, data_dir=None, corpus_dir=None, text_field: str = "text") -> TextSource:
    """Random-access source of {"text", "domain"} dicts for `split` of TFDS data set `name`.

    `moe_corpus` is prepared from `corpus_dir` on first use; any other name must already be prepared in data_dir
    as array_record (for example with `tfds build NAME --file_format=array_record --data_dir=DIR`).
    """
    data_dir = data_dir or DEFAULT_DATA_DIR
    if name == MoeCorpus.name:
        builder = prepare(data_dir, corpus_dir)
        if split not in builder.info.splits:
            raise UserError(f"moe_corpus has no split {split!r}; use one of {sorted(builder.info.splits)}")
        return TextSource(builder.as_data_source(split=split), f"moe_corpus-{builder.builder_config.name}-{split}",
                          builder.info.features["domain"].names, text_field=text_field)
    try:
        builder = tfds.builder(name, data_dir=data_dir)
        src = builder.as_data_source(split=split)
    except Exception as e:  # TFDS raises many types here (not found, not prepared, bad split, wrong format)
        raise UserError(f"TFDS data set {name!r} split {split!r} not readable in {data_dir} "
                        f"({type(e).__name__}); prepare it with `tfds build {name} --file_format=array_record "
                        f"--data_dir={data_dir}`") from e
    features = builder.info.features
    if text_field not in features:
        raise UserError(f"TFDS data set {name!r} has no field {text_field!r}; pass text_field= one of {list(features)}")
    domain = features["domain"] if "domain" in features else None
    names = list(domain.names) if isinstance(domain, tfds.features.ClassLabel) else []
    return TextSource(src, f"{name}-{builder.version}-{split}", names, text_field=text_field)
