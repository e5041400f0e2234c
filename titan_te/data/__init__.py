"""Data registries: tokenizers and datasets (token sources)."""
from titan_te.registry import Registry

TOKENIZERS: Registry = Registry("tokenizer")  # name -> build(data_cfg) -> Tokenizer
DATASETS: Registry = Registry("dataset")  # name -> build(data_cfg, tokenizer) -> TokenSource

from titan_te.data import embedded, files, hf_stream, shards, tokenizers  # noqa: E402,F401  (register entries)
