"""The text a run trains on: corpora, tokenizer, token streams, batches.

`sources` finds and splits the default and local-file corpora, `hub` loads hub datasets, both
into a `corpus.Corpus`; `tokenizer` trains or loads the tokenizer; `windows` tokenizes a corpus
whole and cuts it into training blocks and validation windows; `stream` reads and tokenizes on
demand (`[data] streaming`); `packing` keeps attention within documents (`[data] packing`).
"""

from leanlm.data.corpus import Corpus, quiet_datasets
from leanlm.data.hub import check_data_files, load_hub
from leanlm.data.sources import PROSE_FILE, load_corpus, split_by_file, stdlib_files, take_bytes
from leanlm.data.windows import (
    TokenStreams,
    blocks,
    global_batch_indices,
    selection_windows,
    spread_windows,
    tokenize_corpus,
)

__all__ = [
    "PROSE_FILE",
    "Corpus",
    "TokenStreams",
    "blocks",
    "check_data_files",
    "global_batch_indices",
    "load_corpus",
    "load_hub",
    "quiet_datasets",
    "selection_windows",
    "split_by_file",
    "spread_windows",
    "stdlib_files",
    "take_bytes",
    "tokenize_corpus",
]
