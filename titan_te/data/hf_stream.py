"""`hf`: a Hugging Face dataset streamed through the `datasets` package (pip install 'titan_te[hf]').

`data.path` is what `datasets.load_dataset` takes as its first argument (a hub name such as
`HuggingFaceFW/fineweb`, or a builder such as `json` / `parquet` with `data.hf_data_files`);
`data.hf_subset` and `data.hf_split` pick the part and `data.text_field` the text column. Nothing is
downloaded up front: every data-parallel rank and loader worker streams its own share (whole files
when the dataset has a multiple of that many, else every n-th record), tokenizes documents as they
arrive and packs them into windows of seq_len + 1 tokens (BOS + text + EOS per document).

Shuffling is the dataset's seeded file order plus a buffer of `data.hf_shuffle_buffer` records,
reseeded per epoch. A stream's state is (epoch, records read, token offset into the record the next
window starts in); a restored loader re-reads the consumed records without tokenizing them and then
yields exactly the windows an uninterrupted run would have seen.
"""
from __future__ import annotations

from titan_te.data import DATASETS
from titan_te.data.hf_access import open_stream
from titan_te.errors import DataError
from titan_te.registry import reading


class HFStreamSource:
    """What build_dataloader gets for `hf`: it makes its own stream per rank (see `sequences`)."""

    validation = None

    def __init__(self, dcfg, tokenizer):
        self.dcfg, self.tokenizer = dcfg, tokenizer
        self.name = f"hf:{dcfg.path}"
        self.vocab_size = tokenizer.vocab_size
        first = next(iter(open_stream(dcfg).take(1)), None)  # fail here, not in a loader worker
        if first is None:
            raise DataError(f"data.path: the Hugging Face dataset {dcfg.path!r} (split {dcfg.hf_split}) is empty")
        if dcfg.text_field not in first:
            raise DataError(f"data.path: records of {dcfg.path!r} have no field '{dcfg.text_field}' "
                            f"(fields: {', '.join(first)}; set data.text_field)")

    def split(self, fraction: float):
        raise DataError("validation.enable with data.dataset = 'hf': a streamed dataset has no held-out part; "
                        "tokenize it with `python -m titan_te.data.prepare --input hf:NAME --val_fraction F` "
                        "and train on the tokens dataset, or set validation.enable = false")

    def sequences(self, seq_len: int, batch_size: int, dp_rank: int, dp_world: int, seed: int, shuffle: bool):
        from titan_te.data.hf_sequences import HFSequences  # torch: imported when a loader is built

        return HFSequences(self.dcfg, self.tokenizer, seq_len, dp_rank, dp_world, seed, shuffle)


DATASETS.register("hf")(reading("path", "text_field", "hf_subset", "hf_split", "hf_data_files",
                                  "hf_shuffle_buffer")(HFStreamSource))
