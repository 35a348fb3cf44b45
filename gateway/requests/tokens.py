"""Prompt token counting at the gateway.

The gateway routes on L_r before any engine has tokenized the prompt, and no tokenizer files can be
assumed present, so it estimates: one token per 4 UTF-8 bytes (the usual rule of thumb for English
BPE vocabularies), at least one per non-empty text, plus a fixed overhead per chat message for the
role markers of the chat template. Engines report the exact count in `usage`.
"""

from __future__ import annotations

BYTES_PER_TOKEN = 4
CHAT_MESSAGE_OVERHEAD = 4


def count_text_tokens(text: str) -> int:
    if not text:
        return 0
    return max(1, -(-len(text.encode()) // BYTES_PER_TOKEN))
