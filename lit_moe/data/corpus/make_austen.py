"""How ``austen.jsonl.xz`` and ``austen_bpe4096.json`` were made (kept for provenance; not imported).

Source: the Debian package ``r-cran-janeaustenr`` 1.0.0-1 (MIT-licensed R package by Julia Silge holding
the Project Gutenberg texts of Jane Austen's six novels, which are in the public domain). Its data lives
in an R lazy-load database (``data/Rdata.rdb``/``.rdx``): zlib-compressed, XDR-serialised R character
vectors, one line of text per element. This script decodes them without R, splits each novel into
chapters (one JSON line, i.e. one document, per chapter), re-flows the hard-wrapped paragraphs, and
trains a byte-level BPE tokenizer (4096 entries; ``<pad>`` = 0, ``<eod>`` = 1) on the result.

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb pkg
    python make_austen.py pkg/usr/lib/R/site-library/janeaustenr/data/Rdata .
"""

import gzip
import json
import lzma
import re
import struct
import sys
import zlib

BOOKS = {  # R object name -> title, in publication order
    "sensesensibility": "Sense and Sensibility", "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park", "emma": "Emma", "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


class _Unserializer:
    """Just enough of R's XDR serialisation for the objects in this package."""

    def __init__(self, data: bytes) -> None:
        self.b, self.p, self.refs = data, 0, []
        assert self._raw(2) == b"X\n", "not an XDR R serialisation"
        version = self._int()
        self._int(), self._int()
        if version == 3:
            self._raw(self._int())  # native encoding name

    def _raw(self, n):
        out = self.b[self.p:self.p + n]
        self.p += n
        return out

    def _int(self):
        return struct.unpack(">i", self._raw(4))[0]

    def item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 253, 251, 242):  # NULL, global env, missing arg, empty env
            return None
        if kind == 255:  # reference to an earlier symbol
            ref = flags >> 8
            return self.refs[(ref or self._int()) - 1]
        if kind == 1:  # symbol
            symbol = ("symbol", self.item())
            self.refs.append(symbol)
            return symbol
        if kind == 2:  # pairlist
            out = []
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else None
                out.append((tag, self.item()))
                flags = self._int()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
                if kind == 254:
                    return out
        if kind == 9:  # CHARSXP
            n = self._int()
            return None if n == -1 else self._raw(n).decode("utf-8")
        n = self._int()
        if kind in (10, 13):  # logical, integer
            value = list(struct.unpack(f">{n}i", self._raw(4 * n)))
        elif kind == 16 or kind == 19:  # character vector, list
            value = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported R type {kind}")
        if has_attr:
            return ("attributes", value, self.item())
        return value


def read_books(rdata_prefix: str) -> dict[str, list[str]]:
    index = _Unserializer(gzip.decompress(open(rdata_prefix + ".rdx", "rb").read())).item()
    variables = index[1][0]  # ("attributes", [[offset, length], ...], names)
    positions, names = variables[1], variables[2][0][1]
    db = open(rdata_prefix + ".rdb", "rb").read()
    books = {}
    for name, (offset, length) in zip(names, positions):
        blob = db[offset:offset + length]
        lines = _Unserializer(zlib.decompress(blob[4:])).item()
        books[name] = [line or "" for line in (lines[1] if isinstance(lines, tuple) else lines)]
    return books


CHAPTER = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\b", re.IGNORECASE)


def chapters(lines: list[str]) -> list[str]:
    """Split at chapter headings (front matter joins the first chapter); re-flow paragraphs."""
    parts, current = [], []
    for line in lines:
        if CHAPTER.match(line) and any(l.strip() for l in current) and any(CHAPTER.match(l) for l in current):
            parts.append(current)
            current = []
        current.append(line)
    parts.append(current)
    docs = []
    for part in parts:
        paragraphs = re.split(r"\n\s*\n", "\n".join(part))
        text = "\n\n".join(" ".join(l.strip() for l in p.splitlines() if l.strip()) for p in paragraphs)
        docs.append(re.sub(r"\n{3,}", "\n\n", text).strip())
    return [d for d in docs if d]


def main(rdata_prefix: str, out_dir: str) -> None:
    books = read_books(rdata_prefix)
    records = []
    for name, title in BOOKS.items():
        for i, text in enumerate(chapters(books[name]), start=1):
            records.append({"book": title, "chapter": i, "text": text})
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    with lzma.open(f"{out_dir}/austen.jsonl.xz", "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(payload)
    print(f"{len(records)} chapters, {len(payload)} bytes of JSON lines")

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<pad>", "<eod>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((r["text"] for r in records), trainer=trainer)
    tok.save(f"{out_dir}/austen_bpe4096.json")
    print("tokenizer vocab", tok.get_vocab_size())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
