"""Tokenizers. `byte`: UTF-8 bytes 0..255 plus BOS and EOS; needs no files."""
from __future__ import annotations

import numpy as np

from titan_te.data import TOKENIZERS


class ByteTokenizer:
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


TOKENIZERS.register("byte")(lambda dcfg: ByteTokenizer())


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Embedding rows rounded up for fast GEMMs; the extra ids are never produced by the tokenizer."""
    return -(-vocab_size // multiple) * multiple
