"""Reading documents from text files: .txt (one document per file), .jsonl and .json (one record per
document, the text in `text_field`) and .parquet (a text column; needs pyarrow).

`data.path` may be a file, a folder (searched recursively) or a glob. Every problem names the file
(and the line or byte offset): a missing path, no readable files, invalid UTF-8, a bad JSON record, a
missing text field.
"""
from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Iterator

from titan_te.errors import DataError, unreadable

EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet")


def resolve_files(spec: str, key: str = "data.path") -> list[Path]:
    try:
        return _resolve_files(spec, key)
    except OSError as e:
        raise unreadable(e.filename or spec, e, key) from None


def _resolve_files(spec: str, key: str) -> list[Path]:
    if not spec:
        raise DataError(f"{key} is empty: name a file, a folder or a glob of {', '.join(EXTENSIONS)} files")
    p = Path(spec)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in EXTENSIONS)
    elif glob.has_magic(spec):
        files = sorted(Path(f) for f in glob.glob(spec, recursive=True) if Path(f).is_file())
    else:
        raise DataError(f"{key}: no such file or folder: {spec}")
    files = [f for f in files if f.suffix in EXTENSIONS]
    if not files:
        raise DataError(f"{key}: {spec} holds no {', '.join(EXTENSIONS)} files")
    return files


def _decode(raw: bytes, where: str, base_offset: int = 0) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: invalid UTF-8 at byte offset {base_offset + e.start}") from None


def _text_of(record, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        raise DataError(f"{where}: record has no field '{field}' (set data.text_field)")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field '{field}' is {type(text).__name__}, not text")
    return text


def _loads(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not a JSON record ({e.msg})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read") from None


def _jsonl(path: Path, field: str) -> Iterator[str]:
    offset = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            line = _decode(raw, where, offset).strip()
            offset += len(raw)
            if not line:
                continue
            yield _text_of(_loads(line, where), field, where)


def _json(path: Path, field: str) -> Iterator[str]:
    text = _decode(path.read_bytes(), str(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        yield from _jsonl(path, field)  # JSON Lines saved as .json
        return
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply to read") from None
    records = data if isinstance(data, list) else [data]
    for i, record in enumerate(records):
        yield _text_of(record, field, f"{path} record {i}")


def _parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a parquet file ({type(e).__name__})") from None
    if field not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column '{field}' (columns: {', '.join(pf.schema_arrow.names)}; set data.text_field)")
    kind = pf.schema_arrow.field(field).type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise DataError(f"{path}: column '{field}' holds {kind}, not text (set data.text_field)")
    for batch in pf.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            if text:
                yield text


READERS = {".txt": lambda path, field: iter([_decode(path.read_bytes(), str(path))]),
           ".jsonl": _jsonl, ".json": _json, ".parquet": _parquet}


def iter_documents(files: list[Path], field: str = "text") -> Iterator[tuple[str, Path]]:
    """(text, file) for every non-empty document, in file order."""
    for path in files:
        try:
            for text in READERS[path.suffix](path, field):
                if text:
                    yield text, path
        except OSError as e:  # unreadable (permissions), vanished, or an I/O error
            raise unreadable(path, e) from None
