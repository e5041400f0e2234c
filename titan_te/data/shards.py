"""Pre-tokenized shards (the `tokens` dataset) and their writer (used by `python -m titan_te.data.prepare`).

A shard is three files with one stem, e.g. `train-00000`:
  train-00000.bin       the token ids, little-endian uint16 (vocabulary <= 65536) or uint32, no header
  train-00000.json      the sidecar: format, dtype, vocab_size, num_tokens, num_documents, tokenizer, bos/eos ids
  train-00000.idx.npy   int64 start offsets of the documents (document boundaries)
Shards are read through numpy.memmap, so opening a corpus of any size costs no memory.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from titan_te.data import DATASETS
from titan_te.errors import DataError, unreadable
from titan_te.data.token_source import TokenSource
from titan_te.registry import reading

FORMAT = "titan_te.tokens/1"


SHARD_DTYPES = ("uint16", "uint32")  # unsigned ids only: what prepare writes


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


class ShardWriter:
    """Appends documents (token arrays, BOS/EOS included) to `<folder>/<split>-NNNNN` shards."""

    def __init__(self, folder: Path, split: str, vocab_size: int, tokenizer: str, bos_id: int, eos_id: int,
                 shard_tokens: int = 100_000_000):
        self.folder, self.split, self.vocab_size = Path(folder), split, vocab_size
        self.meta = {"tokenizer": tokenizer, "bos_id": bos_id, "eos_id": eos_id}
        self.dtype, self.shard_tokens = token_dtype(vocab_size), shard_tokens
        self.index, self.total_tokens, self.total_docs = 0, 0, 0
        self._file = None
        self.folder.mkdir(parents=True, exist_ok=True)

    def _open(self) -> None:
        self.stem = self.folder / f"{self.split}-{self.index:05d}"
        self._file = open(self.stem.with_suffix(".bin"), "wb")
        self._tokens, self._starts = 0, []

    def add(self, doc: np.ndarray) -> None:
        if self._file is None:
            self._open()
        if len(doc) and int(doc.max()) >= self.vocab_size:
            raise DataError(f"token id {int(doc.max())} >= vocabulary size {self.vocab_size}")
        self._starts.append(self._tokens)
        self._file.write(np.asarray(doc, dtype=self.dtype).tobytes())
        self._tokens += len(doc)
        if self._tokens >= self.shard_tokens:
            self._close_shard()

    def _close_shard(self) -> None:
        self._file.close()
        np.save(self.stem.with_suffix(".idx.npy"), np.asarray(self._starts, dtype=np.int64))
        side = {"format": FORMAT, "dtype": self.dtype.name, "vocab_size": self.vocab_size,
                "num_tokens": self._tokens, "num_documents": len(self._starts), **self.meta}
        self.stem.with_suffix(".json").write_text(json.dumps(side, indent=1) + "\n")  # written last: complete
        self.total_tokens += self._tokens
        self.total_docs += len(self._starts)
        self._file, self.index = None, self.index + 1

    def close(self) -> None:
        """Finish the last shard (its sidecar is written last: a shard without one is incomplete)."""
        if self._file is not None:
            self._close_shard()

    def abandon(self) -> None:
        """After a failure: close the open file, write nothing more (what was written is never published)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _read_sidecar(path: Path) -> dict:
    try:
        side = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise unreadable(path, e) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a token-shard sidecar ({type(e).__name__}: {e})") from None
    if not isinstance(side, dict) or side.get("format") != FORMAT:
        got = side.get("format") if isinstance(side, dict) else f"a JSON {type(side).__name__}"
        raise DataError(f"{path}: not a titan_te token shard (format {got!r}, expected {FORMAT})")
    if side.get("dtype") not in SHARD_DTYPES:
        raise DataError(f"{path}: dtype {side.get('dtype')!r} is not a token dtype (one of "
                        f"{', '.join(SHARD_DTYPES)}); prepare the shards again")
    for key in ("vocab_size", "num_tokens"):
        if not isinstance(side.get(key), int) or isinstance(side.get(key), bool) or side[key] < 0:
            raise DataError(f"{path}: {key} is {side.get(key)!r}, not a count; prepare the shards again")
    return side


MANIFEST = "prepare.json"  # the shards of one prepare run, written after all of them
SHARD_FILE = re.compile(r"^(train|val)-\d{5}\.(bin|json|idx\.npy)$")


def shard_files(folder: Path) -> list[Path]:
    """The files a prepare run writes (shards, sidecars, indexes, the manifest) in `folder`."""
    return sorted(p for p in Path(folder).iterdir() if SHARD_FILE.match(p.name) or p.name == MANIFEST)


def write_manifest(folder: Path, splits: dict[str, int], info: dict) -> None:
    listing = {split: [f"{split}-{i:05d}" for i in range(n)] for split, n in splits.items()}
    (Path(folder) / MANIFEST).write_text(json.dumps({"format": FORMAT, "shards": listing, **info}, indent=1) + "\n")


def read_manifest(folder: Path) -> dict:
    """The folder's prepare.json. A folder without one is not a complete prepare output (a prepare run
    that failed or was stopped, or files copied by hand) and is never read."""
    path = folder / MANIFEST
    if not path.is_file():
        raise DataError(f"data.path: {folder} has no {MANIFEST}, so it is not a complete output of "
                        f"python -m titan_te.data.prepare (a prepare run that failed or was stopped?); prepare it "
                        f"again")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not all(isinstance(v, list) for v in data["shards"].values()):
            raise TypeError("shards is not a listing per split")
    except OSError as e:
        raise unreadable(path, e) from None
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: not a prepare manifest ({type(e).__name__}); prepare the shards again") from None
    return data


def check_tokenizer(folder: Path, manifest: dict, tokenizer) -> None:
    """The shards were made with this tokenizer: same kind, vocabulary size and vocabulary hash."""
    made, now = manifest.get("tokenizer_identity"), getattr(tokenizer, "identity", None)
    if not isinstance(made, dict) or not now:
        return  # shards of an older prepare, or a custom tokenizer without an identity: sidecar sizes only
    differ = [f"{k} {made.get(k)!r} there, {now.get(k)!r} here" for k in ("kind", "vocab_size", "hash")
              if k in made and made.get(k) != now.get(k)]
    if differ:
        raise DataError(f"data.path: the shards in {folder} were made with another tokenizer ({'; '.join(differ)}); "
                        f"train with the tokenizer they were prepared with (data.tokenizer, data.tokenizer_path) or "
                        f"prepare them again")


def open_shards(folder: Path, split: str, tokenizer, manifest: dict) -> TokenSource | None:
    """The `split` shards of `folder` as one source (None when there are none): exactly the shards its
    manifest lists; a shard another prepare run left behind is an error, never read silently."""
    sides = sorted(folder.glob(f"{split}-*.json"))
    listed = [str(x) for x in manifest["shards"].get(split, [])]
    found = [p.stem for p in sides]
    extra, missing = sorted(set(found) - set(listed)), sorted(set(listed) - set(found))
    if extra or missing:
        what = (f"holds {', '.join(extra[:3])} that its {MANIFEST} does not list (left by an earlier prepare "
                f"run?)" if extra else f"lacks {', '.join(missing[:3])} that its {MANIFEST} lists")
        raise DataError(f"data.path: {folder} {what}; prepare into an empty folder, or again with --overwrite")
    if not sides:
        return None
    arrays, names = [], []
    for side_path in sides:
        side = _read_sidecar(side_path)
        bin_path = side_path.with_suffix(".bin")
        if side["vocab_size"] != tokenizer.vocab_size:
            raise DataError(f"{side_path}: made with a vocabulary of {side['vocab_size']} ({side.get('tokenizer')}) "
                            f"but data.tokenizer has {tokenizer.vocab_size}; use the tokenizer the shards were "
                            f"prepared with")
        dtype = np.dtype(side["dtype"])
        expected = side["num_tokens"] * dtype.itemsize
        if not bin_path.is_file() or bin_path.stat().st_size != expected:
            size = bin_path.stat().st_size if bin_path.is_file() else "missing"
            raise DataError(f"{bin_path}: expected {expected:,} bytes for {side['num_tokens']:,} tokens, found {size}; "
                            f"the shard is truncated or incomplete (prepare it again)")
        if side["num_tokens"]:
            try:
                arrays.append(np.memmap(bin_path, dtype=dtype, mode="r"))
            except OSError as e:
                raise unreadable(bin_path, e) from None
            names.append(str(bin_path))
    return TokenSource(arrays, f"tokens:{folder}/{split}", tokenizer.vocab_size, names)


@DATASETS.register("tokens")
@reading("path")
def build_tokens(dcfg, tokenizer) -> TokenSource:
    folder = Path(dcfg.path)
    if not dcfg.path or not folder.is_dir():
        raise DataError(f"data.path: no such folder of token shards: {dcfg.path!r} "
                        f"(make one with python -m titan_te.data.prepare)")
    manifest = read_manifest(folder)
    check_tokenizer(folder, manifest, tokenizer)
    source = open_shards(folder, "train", tokenizer, manifest)
    if source is None:
        raise DataError(f"data.path: {folder} holds no train-*.json token shards "
                        f"(make them with python -m titan_te.data.prepare)")
    if source.num_tokens == 0:
        raise DataError(f"data.path: the token shards in {folder} are empty")
    source.validation = open_shards(folder, "val", tokenizer, manifest)
    return source
