"""Tokenizers (registry `data.tokenizer`).

- `byte`: UTF-8 bytes 0..255 plus BOS and EOS; needs no files.
- `hf`: a Hugging Face `tokenizer.json` (data.tokenizer_path) through the `tokenizers` library, e.g.
  Llama 3's. BOS/EOS come from a `tokenizer_config.json` beside the file when there is one, else from
  the well-known special tokens the vocabulary holds.
- `tiktoken`: a tiktoken BPE file (Llama 3's original `tokenizer.model`), with Llama 3's split
  pattern and special tokens; needs the `tiktoken` package.
Every tokenizer has vocab_size, bos_id, eos_id, encode(text) -> ids, encode_batch(texts) and
`identity`: what a checkpoint or a shard folder records to tell it from another tokenizer (its kind, its
vocabulary size before padding, and a hash of its vocabulary).
"""
from __future__ import annotations

import base64
import hashlib
import json
import string
from pathlib import Path

import numpy as np

from titan_te.data import TOKENIZERS
from titan_te.errors import DataError, unreadable
from titan_te.registry import reading

BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>")
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


def vocabulary_hash(items) -> str:
    """A short hash of a vocabulary: its (token, id) pairs (or any bytes that define them)."""
    h = hashlib.sha256()
    if isinstance(items, bytes):
        h.update(items)
    else:
        for token, idx in sorted(items, key=lambda kv: kv[1]):
            h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


class ByteTokenizer:
    vocab_size = 258
    bos_id = 256
    eos_id = 257
    identity = {"kind": "byte", "vocab_size": 258, "hash": vocabulary_hash(b"utf-8 bytes, bos 256, eos 257")}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def _tokenizer_file(dcfg, what: str) -> Path:
    if not dcfg.tokenizer_path:
        raise DataError(f"data.tokenizer = '{dcfg.tokenizer}' needs data.tokenizer_path ({what})")
    path = Path(dcfg.tokenizer_path)
    try:
        if path.is_dir():
            path = path / ("tokenizer.json" if dcfg.tokenizer == "hf" else "tokenizer.model")
        found = path.is_file()
        if found:
            with path.open("rb"):  # readable: the libraries that read it next report this as anything
                pass
    except OSError as e:
        raise unreadable(path, e, "data.tokenizer_path") from None
    if not found:
        raise DataError(f"data.tokenizer_path: no such file: {path}")
    return path


PROBE_TEXT = f"{string.ascii_letters} {string.digits} {string.punctuation}"  # what any text tokenizer must keep


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise DataError(f"data.tokenizer_path: {path} is not a Hugging Face tokenizer.json "
                            f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
        self.path = path
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(self._configured("bos_token"), BOS_CANDIDATES, "BOS")
        self.eos_id = self._special(self._configured("eos_token"), EOS_CANDIDATES, "EOS")
        self.identity = {"kind": "hf", "vocab_size": self.vocab_size,
                         "hash": vocabulary_hash(self.tok.get_vocab(with_added_tokens=True).items())}
        self._check_plain_text()

    def _check_plain_text(self) -> None:
        """Plain ASCII text must come out as tokens: a model without an unknown token (and without byte
        fallback) raises on a character it has no token for (WordLevel) or drops it without a word (BPE),
        and the run would train on what is left."""
        encoding = self._encode_one(PROBE_TEXT)
        covered = {i for start, end in encoding.offsets for i in range(start, end)}
        dropped = sorted({c for i, c in enumerate(PROBE_TEXT) if i not in covered and not c.isspace()})
        if dropped:
            raise DataError(f"data.tokenizer_path: {self.path} drops {len(dropped)} plain ASCII characters it has no "
                            f"token for (e.g. {''.join(dropped[:10])!r}): training would skip that text; use a "
                            f"tokenizer with an unknown token or byte fallback")

    def _encode_one(self, text: str):
        try:
            return self.tok.encode(text, add_special_tokens=False)
        except Exception as e:  # the tokenizers package raises a bare Exception for text its model cannot encode
            raise DataError(f"data.tokenizer_path: {self.path} cannot encode the text "
                            f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}); use a tokenizer with "
                            f"an unknown token or byte fallback") from None

    def _configured(self, key: str) -> str | None:
        cfg = self.path.parent / "tokenizer_config.json"
        if not cfg.is_file():
            return None
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
        except OSError as e:
            raise unreadable(cfg, e) from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise DataError(f"{cfg} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise DataError(f"{cfg} holds a JSON {type(data).__name__}, not an object of tokenizer settings")
        value = data.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(value, str):
            raise DataError(f"{cfg}: {key} is {type(value).__name__} {value!r}, not a token string")
        return value

    def _special(self, configured: str | None, candidates, what: str) -> int:
        for token in ([configured] if configured else []) + list(candidates):
            idx = self.tok.token_to_id(token)
            if idx is not None:
                return idx
        raise DataError(f"data.tokenizer_path: {self.path} has no {what} token (looked for "
                        f"{', '.join(([configured] if configured else []) + list(candidates))}); add one to the "
                        f"tokenizer or a tokenizer_config.json beside it")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._encode_one(text).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        try:
            encodings = self.tok.encode_batch(texts, add_special_tokens=False)
        except Exception:  # which text: encode them one by one for the message
            encodings = [self._encode_one(t) for t in texts]
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


# Llama 3's pre-tokenizer split pattern and special tokens (its tiktoken model has 128000 BPE ranks).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256


def _check_bpe_ranks(ranks: dict, path: Path) -> None:
    """What tiktoken takes for granted of a byte-level BPE: ids 0 to n-1, each once (the special tokens
    follow them), and every single byte a token (a text with a byte that is not one panics inside
    tiktoken's Rust core, mid-run)."""
    where = f"data.tokenizer_path: {path}"
    if not ranks:
        raise DataError(f"{where} holds no BPE ranks (an empty file?)")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{where}: its {len(ranks):,} ranks are not the ids 0 to {len(ranks) - 1:,}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(f"{where} lacks {len(missing)} of the 256 single-byte tokens (e.g. 0x{missing[0]:02x}) that "
                        f"a byte-level BPE needs; is it a tiktoken BPE file?")


def _read_bpe_ranks(path: Path) -> dict:
    """A tiktoken BPE file's ranks (a base64 token and its rank a line), read from the file itself: tiktoken's
    own loader keeps a copy of any file it read, by its path, in the temporary folder's data-gym-cache, and
    hands that copy back for a file later replaced at the same path."""
    ranks = {}
    try:
        for line in path.read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except ValueError as e:  # a line that is not two fields, a token not base64, a rank not a number
        raise DataError(f"data.tokenizer_path: {path} is not a tiktoken BPE file ({type(e).__name__})") from None
    return ranks


class TiktokenTokenizer:
    def __init__(self, path: Path):
        try:
            import tiktoken
        except ImportError:
            raise DataError("data.tokenizer = 'tiktoken' needs the tiktoken package: pip install tiktoken") from None
        ranks = _read_bpe_ranks(path)
        _check_bpe_ranks(ranks, path)
        n = len(ranks)
        names = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>"
                                                            for i in range(LLAMA3_NUM_SPECIAL - 2)]
        special = {name: n + i for i, name in enumerate(names)}
        self.enc = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=special)
        self.vocab_size = n + LLAMA3_NUM_SPECIAL
        self.bos_id, self.eos_id = special["<|begin_of_text|>"], special["<|end_of_text|>"]
        pairs = [(t.hex(), i) for t, i in ranks.items()] + list(special.items())
        self.identity = {"kind": "tiktoken", "vocab_size": self.vocab_size, "hash": vocabulary_hash(pairs)}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self.enc.encode_ordinary_batch(texts)]

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])


TOKENIZERS.register("byte")(reading()(lambda dcfg: ByteTokenizer()))
TOKENIZERS.register("hf")(reading("tokenizer_path")(
    lambda dcfg: HFTokenizer(_tokenizer_file(dcfg, "a tokenizer.json file or its folder"))))
TOKENIZERS.register("tiktoken")(reading("tokenizer_path")(
    lambda dcfg: TiktokenTokenizer(_tokenizer_file(dcfg, "a tiktoken .model file"))))


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Embedding rows rounded up for fast GEMMs; the extra ids are never produced by the tokenizer."""
    return -(-vocab_size // multiple) * multiple
