"""Access to a streamed Hugging Face dataset through the `datasets` package (pip install 'titan_te[hf]'):
the package itself, one dataset opened as a stream, and how many records a read fetches. Shared by the
`hf` dataset's source (hf_stream.py) and its sequences (hf_sequences.py)."""
from __future__ import annotations

from titan_te.errors import DataError

READ_BATCH = 256  # records fetched per request


def datasets_package():
    try:
        import datasets
        from datasets.distributed import split_dataset_by_node
    except ImportError:
        raise DataError("data.dataset = 'hf' streams through the datasets package, which is not installed "
                        "(pip install 'titan_te[hf]')") from None
    return datasets, split_dataset_by_node


def open_stream(dcfg):
    datasets, _ = datasets_package()
    try:
        return datasets.load_dataset(dcfg.path, name=dcfg.hf_subset or None, split=dcfg.hf_split,
                                     data_files=dcfg.hf_data_files or None, streaming=True)
    except Exception as e:  # the datasets package raises many kinds (not found, no network, bad split)
        raise DataError(f"data.path: cannot stream the Hugging Face dataset {dcfg.path!r} "
                        f"(subset {dcfg.hf_subset or '-'}, split {dcfg.hf_split}): "
                        f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}") from None
