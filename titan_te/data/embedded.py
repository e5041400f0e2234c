"""`embedded`: a corpus that needs no download, the Python standard library's own source text.

Files are read in sorted order up to a fixed size, so every machine with the same Python version
sees the same corpus.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

from titan_te.data import DATASETS
from titan_te.data.token_source import TokenSource, join_documents

CORPUS_BYTES = 6 * 2**20


def stdlib_documents(limit: int = CORPUS_BYTES):
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= limit:
            return


@DATASETS.register("embedded")
def build_embedded(dcfg, tokenizer) -> TokenSource:
    return TokenSource([join_documents(stdlib_documents(), tokenizer)], "embedded:stdlib", tokenizer.vocab_size)
