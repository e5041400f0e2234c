"""`embedded`: a corpus that needs no download, the Python standard library's own source text.

Files are read in sorted order up to a fixed size, so every machine with the same Python version
sees the same corpus.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from titan_te.data import DATASETS
from titan_te.data.token_source import TokenSource, join_documents
from titan_te.registry import reading

CORPUS_BYTES = 6 * 2**20


SKIPPED_DIRS = {"test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py files, sorted; installed packages and the test suite are not walked."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found)


def stdlib_documents(limit: int = CORPUS_BYTES):
    total = 0
    for path in stdlib_files(Path(sysconfig.get_paths()["stdlib"])):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # not UTF-8, or removed since the walk (a package upgrade)
            continue
        yield text
        total += len(text)
        if total >= limit:
            return


@DATASETS.register("embedded")
@reading()  # none of data.path, data.text_field, data.hf_*
def build_embedded(dcfg, tokenizer) -> TokenSource:
    return TokenSource([join_documents(stdlib_documents(), tokenizer)], "embedded:stdlib", tokenizer.vocab_size)
