"""Token sources: token streams (documents joined with BOS/EOS) read in windows of seq_len + 1.

A source holds one or more shards (numpy arrays or memmaps of token ids). Windows never cross a
shard: window i of a shard starts at i * seq_len and spans seq_len + 1 tokens (the last one is the
label of the one before). Every window read is checked against the vocabulary size, so a corrupt
shard is reported by name and offset instead of crashing an embedding lookup.
"""
from __future__ import annotations

import itertools

import numpy as np

from titan_te.errors import DataError


class TokenSource:
    def __init__(self, shards: list[np.ndarray], name: str, vocab_size: int | None = None,
                 shard_names: list[str] | None = None):
        self.shards = [s for s in shards]
        self.name = name
        self.vocab_size = vocab_size
        self.shard_names = shard_names or [f"{name}[{i}]" for i in range(len(shards))]
        self._seq_len = None
        self._offsets = None
        self.validation: TokenSource | None = None  # a dataset's own held-out split, if it has one

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.shards)

    def _index(self, seq_len: int) -> np.ndarray:
        """Cumulative window counts per shard for this seq_len."""
        if self._seq_len != seq_len:
            counts = [max((len(s) - 1) // seq_len, 0) for s in self.shards]
            self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            self._seq_len = seq_len
        return self._offsets

    def num_windows(self, seq_len: int) -> int:
        return int(self._index(seq_len)[-1])

    def window(self, idx: int, seq_len: int) -> np.ndarray:
        offsets = self._index(seq_len)
        shard = int(np.searchsorted(offsets, idx, side="right") - 1)
        start = (idx - offsets[shard]) * seq_len
        w = np.asarray(self.shards[shard][start:start + seq_len + 1], dtype=np.int64)
        if self.vocab_size is not None and len(w) and int(w.max()) >= self.vocab_size:
            bad = int(np.argmax(w >= self.vocab_size))
            raise DataError(f"{self.shard_names[shard]}: token id {int(w[bad])} at token offset {start + bad} is "
                            f">= the vocabulary size {self.vocab_size}; the shard is corrupt or was made with "
                            f"another tokenizer (data.tokenizer)")
        return w

    def split(self, fraction: float) -> tuple["TokenSource", "TokenSource"]:
        """(head, tail): the last `fraction` of the tokens (taken from the last shards) held out."""
        hold = int(self.num_tokens * fraction)
        head, tail, head_names, tail_names = [], [], [], []
        for shard, name in zip(reversed(self.shards), reversed(self.shard_names)):
            take = min(hold, len(shard))
            if take:
                tail.insert(0, shard[len(shard) - take:])
                tail_names.insert(0, f"{name} (held out)")
            if take < len(shard):
                head.insert(0, shard[:len(shard) - take])
                head_names.insert(0, name)
            hold -= take
        return (TokenSource(head, self.name, self.vocab_size, head_names),
                TokenSource(tail, f"{self.name} (held out)", self.vocab_size, tail_names))


def ArrayTokenSource(tokens: np.ndarray, name: str, vocab_size: int | None = None) -> TokenSource:
    """A source of one in-memory token array."""
    return TokenSource([tokens], name, vocab_size)


def frame_document(ids, tokenizer) -> np.ndarray:
    """One document's token ids between the tokenizer's BOS and EOS (int32)."""
    out = np.empty(len(ids) + 2, dtype=np.int32)
    out[0], out[-1] = tokenizer.bos_id, tokenizer.eos_id
    out[1:-1] = ids
    return out


ENCODE_BATCH = 256  # documents per tokenizer call (the hf and tiktoken tokenizers encode a batch on all cores)


def join_documents(docs, tokenizer) -> np.ndarray:
    """BOS + tokens + EOS per document, concatenated (int32)."""
    docs, parts = iter(docs), []
    while batch := list(itertools.islice(docs, ENCODE_BATCH)):
        parts += [frame_document(ids, tokenizer) for ids in tokenizer.encode_batch(batch)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
