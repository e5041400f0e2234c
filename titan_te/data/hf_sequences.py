"""The streamed `hf` dataset's sequences: each data-parallel rank and loader worker streams its own share,
tokenizes documents as they arrive and packs them into windows of seq_len + 1 tokens (see hf_stream.py).

A stream's state is (epoch, records read, token offset into the record the next window starts in); a
restored loader re-reads the consumed records without tokenizing them and then yields exactly the
windows an uninterrupted run would have seen.
"""
from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from titan_te.data.hf_access import READ_BATCH, datasets_package, open_stream
from titan_te.data.token_source import frame_document
from titan_te.errors import DataError

logger = logging.getLogger("titan_te")


class HFSequences(IterableDataset):
    def __init__(self, dcfg, tokenizer, seq_len: int, dp_rank: int, dp_world: int, seed: int, shuffle: bool):
        self.dcfg, self.tokenizer, self.seq_len = dcfg, tokenizer, seq_len
        self.dp_rank, self.dp_world, self.seed, self.shuffle = dp_rank, dp_world, seed, shuffle
        self.epoch, self.record, self.offset = 0, 0, 0

    def _texts(self, epoch: int, part: int, parts: int):
        """(record index, text) of this rank/worker's share of one epoch."""
        _, split_by_node = datasets_package()
        ds = open_stream(self.dcfg)
        if self.shuffle:
            ds = ds.shuffle(seed=self.seed, buffer_size=self.dcfg.hf_shuffle_buffer)
            ds.set_epoch(epoch)
        ds = split_by_node(ds, rank=part, world_size=parts)
        field, i = self.dcfg.text_field, 0
        # .iter() reads in this process; plain iteration inside a DataLoader worker would re-split by worker.
        for batch in ds.iter(batch_size=READ_BATCH):
            if field not in batch:
                raise DataError(f"{self.dcfg.path}: a record has no field '{field}' (set data.text_field)")
            for text in batch[field]:
                yield i, text
                i += 1

    def _tokens(self, text) -> np.ndarray:
        if text is None or text == "":
            return np.zeros(0, np.int32)
        if not isinstance(text, str):  # as the files dataset: a column of other values is a mistake
            raise DataError(f"{self.dcfg.path}: field '{self.dcfg.text_field}' is {type(text).__name__}, not text "
                            f"(set data.text_field)")
        return frame_document(self.tokenizer.encode(text), self.tokenizer)

    def __iter__(self):
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        part, parts = self.dp_rank * n_workers + worker, self.dp_world * n_workers
        span = self.seq_len + 1
        while True:
            start_record, start_offset, windows = self.record, self.offset, 0
            buf, pos = np.zeros(0, np.int32), 0  # tokens read, and where the next window starts in them
            segments = deque()  # [record, its token count, its tokens at or after `pos`]
            for i, text in self._texts(self.epoch, part, parts):
                if i < start_record:
                    continue  # consumed before the restore
                toks = self._tokens(text)
                full = len(toks)
                if i == start_record:
                    toks = toks[start_offset:]
                if not len(toks):
                    continue
                buf, pos = np.concatenate([buf[pos:], toks]), 0  # once per record, not per window
                segments.append([i, full, len(toks)])
                while len(buf) - pos >= span:
                    window = torch.from_numpy(buf[pos:pos + span].astype(np.int64))
                    pos += self.seq_len
                    drop = self.seq_len  # the next window starts seq_len tokens later
                    while drop and drop >= segments[0][2]:
                        drop -= segments.popleft()[2]
                    segments[0][2] -= drop
                    self.record, self.offset = segments[0][0], segments[0][1] - segments[0][2]
                    windows += 1
                    yield {"input": window[:-1], "labels": window[1:], "epoch": self.epoch}
            if windows == 0 and start_record == 0 and start_offset == 0:
                raise DataError(f"hf:{self.dcfg.path}: share {part} of {parts} (data-parallel rank x loader "
                                f"worker) holds less than one sequence of training.seq_len + 1 = {span} tokens; "
                                f"use fewer data.num_workers or ranks, a shorter seq_len, or more data")
            self.epoch, self.record, self.offset = self.epoch + 1, 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "record": self.record, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.record, self.offset = int(state["epoch"]), int(state["record"]), int(state["offset"])
        if self.record:
            logger.info(f"data: resuming hf:{self.dcfg.path} at epoch {self.epoch}, record {self.record:,} "
                        f"(re-reading the records before it)")
