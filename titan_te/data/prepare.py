"""Tokenize text into `tokens` shards, with worker processes and a progress line.

    python -m titan_te.data.prepare --input corpus/ --output shards/ --tokenizer hf \\
        --tokenizer_path Llama-3.1-8B/tokenizer.json --workers 8 --val_fraction 0.005

--input is a .txt/.jsonl/.json/.parquet file, a folder or a glob (like data.path), or `hf:NAME` for a
Hugging Face dataset streamed through the `datasets` package (--hf_subset, --hf_split). Every
document gets BOS and EOS; a val_fraction of the documents, spread evenly (0.25: every fourth), goes
to the `val` shards. Then
train with `--data.dataset=tokens --data.path=shards/` (the validation section reads `val` shards).
"""
from __future__ import annotations

from titan_te.preemption import SIGNALS

if __name__ == "__main__":
    SIGNALS.install_early()  # before the imports below: a Ctrl-C while they load is one line too

import collections
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import numpy as np

from titan_te.data.documents import iter_documents, resolve_files
from titan_te.errors import DataError
from titan_te.data.shards import MANIFEST, ShardWriter, shard_files, write_manifest
from titan_te.data.token_source import frame_document
from titan_te.durable import sync, sync_folder
from titan_te.run_folder import LOCK, FolderLock, why
from titan_te.paths import check_path
from titan_te.tool_cli import OneLineParser, run_tool

MAX_WORKERS = 256  # tokenizer processes: a typo such as --workers 6400 would start them all


@dataclass
class TokenizerArgs:
    """The slice of the [data] section a tokenizer reads."""
    tokenizer: str
    tokenizer_path: str


def build_tokenizer(targs: TokenizerArgs):
    from titan_te.data import TOKENIZERS

    if targs.tokenizer not in TOKENIZERS:
        raise DataError(f"--tokenizer: {TOKENIZERS.miss_message(targs.tokenizer)}")
    return TOKENIZERS.get(targs.tokenizer)(targs)


_WORKER_TOKENIZER = None


def _init_worker(targs: TokenizerArgs) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = build_tokenizer(targs)


class Tokenizers:
    """Tokenizer processes, each with a pipe of its own. No queue or lock is shared between them, so ending
    them at any moment (a failure, Ctrl-C) can never leave the others or this process waiting; they never
    see Ctrl-C or a closed terminal themselves, and their stderr is /dev/null (their failures travel back
    through the pipe and are raised here)."""

    def __init__(self, n: int, targs: TokenizerArgs):
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        saved = os.dup(2)
        try:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), 2)  # the children's fd 2, from their first instruction on
            for _ in range(n):
                here, there = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(there, targs), daemon=True)
                proc.start()
                there.close()
                self.procs.append(proc)
                self.conns.append(here)
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    def map(self, batches):
        """The tokens of each batch, in order: batch i goes to process i mod n, one at a time each (a
        process never writes a result while this one writes it the next batch)."""
        waiting: collections.deque = collections.deque()
        for i, batch in enumerate(batches):
            w = i % len(self.conns)
            if len(waiting) == len(self.conns):
                yield self._result(waiting.popleft())
            self.conns[w].send(batch)
            waiting.append(w)
        while waiting:
            yield self._result(waiting.popleft())

    def _result(self, w: int):
        try:
            out = self.conns[w].recv()
        except EOFError:
            raise RuntimeError(f"tokenizer process {w} died (exit code {self.procs[w].exitcode})") from None
        if isinstance(out, BaseException):
            raise out
        return out

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        self.end()

    def end(self) -> None:
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


def _serve(conn, targs: TokenizerArgs) -> None:
    """A tokenizer process: batches in, token arrays (or the exception) out, until None."""
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    _init_worker(targs)
    while (batch := conn.recv()) is not None:
        try:
            conn.send(_tokenize(batch))
        except Exception as e:  # noqa: BLE001 -- sent to the main process, which raises it
            conn.send(e)


def _tokenize(texts: list[str]) -> list[np.ndarray]:
    tok = _WORKER_TOKENIZER
    return [frame_document(ids, tok) for ids in tok.encode_batch(texts)]


def hf_documents(name: str, subset: str | None, split: str, field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise DataError("--input hf:...: streaming a Hugging Face dataset needs the datasets package "
                        "(pip install 'titan_te[hf]')") from None
    try:
        ds = datasets.load_dataset(name, subset, split=split, streaming=True)
    except Exception as e:
        raise DataError(f"--input hf:{name}: cannot open it ({type(e).__name__}: {str(e)[:200]})") from None
    for i, record in enumerate(ds):
        if field not in record:
            raise DataError(f"hf:{name} record {i}: no field '{field}' (set --text_field)")
        if record[field]:
            yield record[field]


class Progress:
    """Progress on stderr: tokens, tokens/s, documents, share done, ETA. On a terminal one line refreshed
    twice a second (cleared again if the run fails, so the error stays one line); into a file or pipe a
    line every 30 s, and the final one."""

    def __init__(self, total_bytes: int | None):
        self.total, self.t0 = total_bytes, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.every = 0.5 if self.tty else 30.0
        self.last = 0.0 if self.tty else self.t0
        self.open = False  # a terminal line waiting for its newline

    def update(self, tokens: int, docs: int, done_bytes: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.every:
            return
        self.last = now
        rate = tokens / max(now - self.t0, 1e-9)
        line = f"prepare: {tokens / 1e6:,.2f} M tokens, {rate / 1e6:,.2f} M tokens/s, {docs:,} documents"
        if self.total:  # text bytes over file bytes: JSON keys and compression make it an estimate
            frac = 1.0 if final else min(done_bytes / self.total, 0.99)
            eta = (now - self.t0) * (1 - frac) / max(frac, 1e-9)
            line += f", {100 * frac:5.1f}%, ETA {int(eta) // 60}:{int(eta) % 60:02d}"
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + line + end, end="", file=sys.stderr, flush=True)
        self.open = self.tty and not end

    def clear(self) -> None:
        if self.open:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)
            self.open = False


def _batches(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    batch = []
    for text in docs:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


STAGING, OLD = ".prepare-staging", ".prepare-old"


def _check_output(output: Path, overwrite: bool) -> list[Path]:
    """Refuse an --output that is a file, or not empty without --overwrite; returns what an earlier
    prepare run wrote there (replaced on success)."""
    if output.exists() and not output.is_dir():
        raise DataError(f"--output {output} is a file, not a folder")
    if not output.is_dir():
        return []
    try:
        present = [p for p in output.iterdir() if p.name not in (LOCK, STAGING, OLD)]
    except OSError as e:
        raise DataError(f"--output {output} cannot be read ({why(e)})") from None
    ours = shard_files(output)
    if present and not overwrite:
        raise DataError(f"--output {output} is not empty ({len(ours)} file(s) of an earlier prepare run, "
                        f"{len(present) - len(ours)} other); add --overwrite to replace the shards, or choose an "
                        f"empty folder")
    return ours


def _publish(output: Path, staging: Path, old: list[Path]) -> None:
    """Swap the new shards in. prepare.json is the commit: the old one goes first and the new one last, so
    a folder is never read with a mix of runs (the `tokens` dataset refuses a folder without it). The new
    files are synced to the disk before the old ones go, so a crash of the machine cannot lose both."""
    sync_folder(staging)
    aside = output / OLD
    aside.mkdir(exist_ok=True)
    old = sorted(old, key=lambda p: p.name != MANIFEST)  # the old manifest first
    for p in old:
        p.rename(aside / p.name)
    new = sorted(staging.iterdir(), key=lambda p: p.name == MANIFEST)  # the new manifest last
    for p in new:
        p.rename(output / p.name)
    sync(output)
    shutil.rmtree(aside, ignore_errors=True)
    staging.rmdir()


def prepare(inputs: str, output: Path, targs: TokenizerArgs, workers: int = 1, val_fraction: float = 0.0,
            text_field: str = "text", shard_tokens: int = 100_000_000, batch_docs: int = 64,
            hf_subset: str | None = None, hf_split: str = "train", overwrite: bool = False) -> dict:
    """Tokenize `inputs` into shards under `output`; returns the counts per split.

    Everything is checked before --output is touched; the shards are written into `<output>/.prepare-staging`
    and published only once all of them and their manifest are on disk. A failure, a full disk or a stop
    signal leaves --output as it was. One prepare run writes into a folder at a time (its `.lock`)."""
    output = Path(output)
    old = _check_output(output, overwrite)
    tok = build_tokenizer(targs)
    if inputs.startswith("hf:"):
        docs, total_bytes = hf_documents(inputs[3:], hf_subset, hf_split, text_field), None
    else:
        files = resolve_files(inputs, "--input")
        docs = (text for text, _ in iter_documents(files, text_field))
        total_bytes = sum(f.stat().st_size for f in files)
    lock = FolderLock(output, "--output", "choose another --output", holder="prepare", error=DataError)
    lock.acquire()
    staging = output / STAGING
    try:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed prepare run left
        shutil.rmtree(output / OLD, ignore_errors=True)
        old = _check_output(output, overwrite)  # under the lock: as it is now
        staging.mkdir()
        counts = _write_shards(docs, total_bytes, staging, tok, targs, workers, val_fraction, shard_tokens,
                               batch_docs, inputs)
        _publish(output, staging, old)
    except OSError as e:
        raise DataError(f"--output {output}: cannot write the shards ({why(e)}{': ' + e.filename if e.filename else ''})"
                        f"; nothing was published, --output is as it was") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        lock.release()
    return counts


def _write_shards(docs, total_bytes, staging: Path, tok, targs, workers, val_fraction, shard_tokens, batch_docs,
                  inputs) -> dict:
    writers = {split: ShardWriter(staging, split, tok.vocab_size, targs.tokenizer, tok.bos_id, tok.eos_id,
                                  shard_tokens) for split in ("train", "val")}
    held_out = Fraction(val_fraction).limit_denominator(10**6)  # 0.005 is exactly 1/200: every 200th document
    progress = Progress(total_bytes)
    n_docs = n_tokens = done_bytes = 0
    pool = Tokenizers(workers, targs) if workers > 1 else None
    if pool is None:
        _init_worker(targs)

    def sized(batches):  # count input size as the batches go out
        nonlocal done_bytes
        for b in batches:
            done_bytes += sum(len(t.encode("utf-8")) for t in b)
            yield b

    try:
        batches = sized(_batches(docs, batch_docs))
        results = pool.map(batches) if pool else map(_tokenize, batches)
        for tokenized in results:
            for ids in tokenized:
                # document n is held out when the count of held-out documents, fraction x (n + 1), steps up
                split = "val" if (n_docs + 1) * held_out // 1 > n_docs * held_out // 1 else "train"
                writers[split].add(ids)
                n_docs += 1
                n_tokens += len(ids)
            progress.update(n_tokens, n_docs, done_bytes)
        for w in writers.values():
            w.close()
    except BaseException:
        progress.clear()
        if pool is not None:
            for proc in pool.procs:
                proc.kill()
            pool.end()
            pool = None
        raise
    finally:
        if pool is not None:
            pool.close()
        for w in writers.values():
            w.abandon()
    progress.update(n_tokens, n_docs, done_bytes, final=True)
    if n_docs == 0:
        raise DataError(f"--input {inputs}: no documents found")
    write_manifest(staging, {split: w.index for split, w in writers.items()},
                   {"input": inputs, "tokenizer": targs.tokenizer, "vocab_size": tok.vocab_size,
                    "tokenizer_identity": getattr(tok, "identity", None), "documents": n_docs, "tokens": n_tokens})
    return {split: {"documents": w.total_docs, "tokens": w.total_tokens, "shards": w.index}
            for split, w in writers.items()}


def main(argv: list[str] | None = None, exits_after: bool = False) -> int:
    return run_tool("prepare error", lambda: _main(sys.argv[1:] if argv is None else argv), exits_after)


def _main(argv: list[str]) -> int:
    ap = OneLineParser(prog="python -m titan_te.data.prepare", description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="file, folder, glob, or hf:NAME")
    ap.add_argument("--output", required=True, help="folder for the shards")
    ap.add_argument("--tokenizer", default="byte", help="byte, hf or tiktoken (as data.tokenizer)")
    ap.add_argument("--tokenizer_path", default="", help="tokenizer file (as data.tokenizer_path)")
    ap.add_argument("--text_field", default="text", help="field / column holding the text")
    ap.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2) - 1))
    ap.add_argument("--val_fraction", type=float, default=0.0, help="share of documents held out for validation")
    ap.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard file")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the shards of an earlier prepare run in --output (other files are kept)")
    ap.add_argument("--hf_subset", default=None)
    ap.add_argument("--hf_split", default="train")
    a = ap.parse_args(argv)
    if not 1 <= a.workers <= MAX_WORKERS or not 0 <= a.val_fraction < 1 or a.shard_tokens < 1:
        raise DataError(f"--workers must be within [1, {MAX_WORKERS}], --shard_tokens >= 1 and --val_fraction "
                        f"within [0, 1)")
    for key in ("input", "output", "tokenizer_path"):
        check_path(f"--{key}", getattr(a, key), "", required=key != "tokenizer_path")
    SIGNALS.doing(f"preparing {a.output} (nothing was published there)")
    counts = prepare(a.input, Path(a.output), TokenizerArgs(a.tokenizer, a.tokenizer_path), a.workers,
                     a.val_fraction, a.text_field, a.shard_tokens, hf_subset=a.hf_subset, hf_split=a.hf_split,
                     overwrite=a.overwrite)
    for split, c in counts.items():
        print(f"{split}: {c['documents']:,} documents, {c['tokens']:,} tokens in {c['shards']} shard(s) under {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(exits_after=True))
