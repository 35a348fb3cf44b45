"""Incremental detokenisation with stop strings, for streamed text that is always valid and final.

Text is decoded over a window of recent tokens (the prefix/read offsets of TGI and vLLM): a token that ends
in the middle of a multi-byte character decodes to U+FFFD and is held back until the character completes.
Text that could still turn into a stop string is held back too; when a stop string appears, the text
ends just before it.
The tokenizer is anything that decodes token ids (`Decoder`): a Hugging Face tokenizer for the torch engine,
the simulated engine's word list for its made-up text.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What `IncrementalText` asks of a tokenizer (a Hugging Face `PreTrainedTokenizerBase` is one)."""

    def decode(self, token_ids: list[int], /, skip_special_tokens: bool = ...) -> object: ...


class IncrementalText:
    def __init__(self, tokenizer: Decoder, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._prefix = self._read = 0
        self.text = ""        # all decoded text so far (cut at a stop string once one appears)
        self._sent = 0        # characters of `text` already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def _advance(self, final: bool) -> None:
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith(REPLACEMENT)):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that is now safe to send (maybe empty). Sets `stopped`."""
        self._ids.append(token_id)
        self._advance(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The sequence ended: everything not sent yet (up to a stop string)."""
        self._advance(final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = min((i for i in (self.text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped, final = self.text[:cut], True, True
        end = len(self.text) if final else len(self.text) - self._pending_stop_prefix()
        delta = self.text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return delta

    def _pending_stop_prefix(self) -> int:
        """Length of the longest tail of the text that a stop string starts with."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if s.startswith(self.text[-k:]):
                    longest = k
                    break
        return longest
