"""`files`: text files (.txt, .jsonl/.json, .parquet) tokenized at startup.

Fine for corpora up to a few hundred MB; for more, tokenize once with `python -m titan_te.data.prepare`
and train on the `tokens` dataset.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from titan_te.data import DATASETS
from titan_te.data.documents import iter_documents, resolve_files
from titan_te.errors import DataError
from titan_te.data.token_source import TokenSource, join_documents
from titan_te.registry import reading

logger = logging.getLogger("titan_te")


@DATASETS.register("files")
@reading("path", "text_field")
def build_files(dcfg, tokenizer) -> TokenSource:
    files = resolve_files(dcfg.path)
    t0 = time.perf_counter()
    tokens = join_documents((text for text, _ in iter_documents(files, dcfg.text_field)), tokenizer)
    docs = int(np.count_nonzero(tokens == tokenizer.bos_id))
    if docs == 0:
        raise DataError(f"data.path: {dcfg.path} holds no documents (all {len(files)} file(s) are empty)")
    logger.info(f"data: {docs:,} documents, {len(tokens):,} tokens from {len(files)} file(s) in "
                f"{time.perf_counter() - t0:.1f}s")
    return TokenSource([tokens], f"files:{dcfg.path}", tokenizer.vocab_size)
