"""Training batches: drawn from the in-memory blocks, or cut from a text stream on the fly.

`[data] streaming = true` reads the training split as a `datasets.IterableDataset`, tokenizes a
document at a time and cuts the concatenation into `seq_len` windows: exactly `data.blocks` of
the same text, without holding its token ids. Step s takes windows `[s G, (s + 1) G)` of the
global batch G, process r its slice. The position after a step (the dataset's state before the
current document, and the offset in it) is small and checkpointed (`BatchSource.state`), so a
resume continues with the very windows an uninterrupted run would take. The stream restarts
at its end (the next epoch).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from leanlm.data.windows import blocks, global_batch_indices

if TYPE_CHECKING:
    import datasets


class WindowStream:
    """Windows `(n, seq_len)` cut from a stream of documents tokenized on the fly.

    Args:
        dataset: documents in a `text` column.
        tokenizer: a fast HF tokenizer with an EOS token (appended to every document).
        seq_len: window length.
    """

    def __init__(self, dataset: datasets.IterableDataset, tokenizer: Any, seq_len: int) -> None:
        self.dataset, self.tokenizer, self.seq_len = dataset, tokenizer, seq_len
        self.eos = tokenizer.eos_token_id
        self._start = copy.deepcopy(dataset.state_dict())
        self.epoch = 0
        self._iter = iter(dataset)
        self._doc = np.zeros(0, dtype=np.int64)
        self._doc_state = self._start  # the dataset's state before `_doc` was read
        self._pos = 0  # tokens of `_doc` already cut into windows
        self._skip = 0  # on resume: tokens of the next document read that were cut before
        self._epoch_tokens = 0

    def _next_document(self) -> None:
        state = self.dataset.state_dict()
        row = next(self._iter, None)
        if row is None:  # end of the stream: the next epoch reads it again from the start
            if not self._epoch_tokens:
                raise ValueError("the training stream holds no text; check `data.data_files`")
            self.epoch, self._epoch_tokens = self.epoch + 1, 0
            self.dataset.load_state_dict(copy.deepcopy(self._start))
            self._iter = iter(self.dataset)
            state = self.dataset.state_dict()
            row = next(self._iter)
        ids = self.tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        self._doc = np.asarray([*ids, self.eos], dtype=np.int64)
        self._doc_state = state
        self._pos, self._skip = self._skip, 0
        self._epoch_tokens += self._doc.size

    def take(self, n: int) -> torch.Tensor:
        """The next `n` windows, `(n, seq_len)` int64."""
        out = np.empty(n * self.seq_len, dtype=np.int64)
        filled = 0
        while filled < out.size:
            if self._pos >= self._doc.size:
                self._next_document()
                continue
            count = min(out.size - filled, self._doc.size - self._pos)
            out[filled : filled + count] = self._doc[self._pos : self._pos + count]
            self._pos += count
            filled += count
        return torch.from_numpy(out).view(n, self.seq_len)

    def state(self) -> dict[str, Any]:
        """Where the stream stands (JSON data): `load_state` continues from here."""
        return {"dataset": self._doc_state, "offset": self._pos, "epoch": self.epoch}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of a stream over the same documents."""
        self.dataset.load_state_dict(copy.deepcopy(state["dataset"]))
        self._iter = iter(self.dataset)
        self.epoch = state["epoch"]
        self._doc, self._pos, self._skip = np.zeros(0, dtype=np.int64), 0, state["offset"]
        self._epoch_tokens = 1  # this epoch has text: the document about to be read again


def first_windows(
    dataset: datasets.IterableDataset, tokenizer: Any, seq_len: int, count: int
) -> torch.Tensor:
    """The first `count` windows `(count, seq_len)` of a stream (0 = every whole window).

    Reads only as many documents as those windows need (all of them for `count` = 0).
    """
    eos = tokenizer.eos_token_id
    pieces, held = [], 0
    for row in dataset:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        pieces.append(np.asarray([*ids, eos], dtype=np.int64))
        held += len(ids) + 1
        if count and held >= count * seq_len:
            break
    stream = torch.from_numpy(np.concatenate(pieces) if pieces else np.zeros(0, np.int64))
    return blocks(stream, seq_len, limit=count)


class BatchSource(Protocol):
    """The trainer's global batches: `global_batch(step, size)` for consecutive steps."""

    num_sequences: int | None
    """Training sequences there are (None for a stream)."""

    def global_batch(self, step: int, size: int) -> torch.Tensor:
        """The `size` sequences `(size, seq_len)` of optimizer step `step`."""
        ...

    def state(self) -> dict[str, Any]:
        """The data position after the last batch (JSON data, stored in checkpoints)."""
        ...

    def load_state(self, state: dict[str, Any], step: int) -> None:
        """Continue at step `step` from a checkpoint's `state()`."""
        ...


class BlockBatches:
    """Shuffled in-memory blocks (`data.global_batch_indices`).

    A step's batch is a pure function of the step, so the position needs no state.
    """

    def __init__(self, blocks: torch.Tensor, *, seed: int) -> None:
        self.blocks, self.seed = blocks, seed
        self.num_sequences: int | None = blocks.shape[0]

    def global_batch(self, step: int, size: int) -> torch.Tensor:
        """`blocks[global_batch_indices(step)]`."""
        index = global_batch_indices(
            step, global_batch=size, num_blocks=self.blocks.shape[0], seed=self.seed
        )
        return self.blocks[index]

    def state(self) -> dict[str, Any]:
        """Nothing: the step number is the position."""
        return {}

    def load_state(self, state: dict[str, Any], step: int) -> None:
        """Nothing to restore."""


class StreamBatches:
    """Consecutive windows of a `WindowStream`, one global batch per step."""

    def __init__(self, stream: WindowStream) -> None:
        self.stream = stream
        self.num_sequences: int | None = None
        self.next_step = 0

    def global_batch(self, step: int, size: int) -> torch.Tensor:
        """The next `size` windows of the stream (steps must come in order)."""
        assert step == self.next_step, f"stream at step {self.next_step}, asked for {step}"
        self.next_step += 1
        return self.stream.take(size)

    def state(self) -> dict[str, Any]:
        """The stream position and the next step."""
        return {"stream": self.stream.state(), "step": self.next_step}

    def load_state(self, state: dict[str, Any], step: int) -> None:
        """Continue the stream where the checkpoint of step `step` left it."""
        if state.get("step") != step or "stream" not in state:
            raise ValueError(
                f"the checkpoint of step {step} has no stream position for step {step} "
                f"(found {state.get('step')!r}); rerun without --resume"
            )
        self.stream.load_state(state["stream"])
        self.next_step = step
