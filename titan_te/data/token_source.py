"""A token source: one long token stream (documents joined with BOS/EOS) read in windows."""
from __future__ import annotations

import numpy as np


class ArrayTokenSource:
    """Windows of seq_len + 1 tokens; window i starts at i * seq_len (one token overlaps for labels)."""

    def __init__(self, tokens: np.ndarray, name: str):
        self.tokens = tokens
        self.name = name

    def num_windows(self, seq_len: int) -> int:
        return max((len(self.tokens) - 1) // seq_len, 0)

    def window(self, idx: int, seq_len: int) -> np.ndarray:
        start = idx * seq_len
        return np.asarray(self.tokens[start:start + seq_len + 1], dtype=np.int64)


def join_documents(docs, tokenizer) -> np.ndarray:
    parts = []
    for text in docs:
        parts.append(np.array([tokenizer.bos_id], dtype=np.int32))
        parts.append(np.asarray(tokenizer.encode(text), dtype=np.int32))
        parts.append(np.array([tokenizer.eos_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
