"""A request's generated text, decoded as its tokens arrive.

Decoding every token list from the start costs time that grows with the output (about 80 us
for 128 GPT-2 tokens, 45 us for 64), on every token. When the tokenizer ``concatenates``
(byte-level BPE), the text of the tokens so far is a fixed head (the text up to a point where
it ended in a whole character) plus the text of the tokens after it, so only those are decoded;
the head moves on every ``ANCHOR_TOKENS`` tokens. Other tokenizers decode the whole list.
"""
from __future__ import annotations

from typing import Optional

ANCHOR_TOKENS = 16  # tokens decoded again at most, past the head, on each call


class GeneratedText:
    """``text(tokens)``: the text of ``tokens``, which only grows between calls (a prefix of
    the next call's list)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.incremental = tokenizer is not None and tokenizer.concatenates
        self.head, self.anchor = "", 0  # the text of tokens[:anchor]

    def text(self, tokens: list[int], upto: Optional[int] = None) -> str:
        """The text of ``tokens[:upto]`` (all when None; ``upto`` may not fall before the head's end)."""
        if self.tokenizer is None:
            return ""
        end = len(tokens) if upto is None else upto
        if not self.incremental:
            return self.tokenizer.decode(tokens[:end])
        if end < self.anchor:
            raise ValueError(f"text up to token {end}, before the decoded head ({self.anchor} tokens)")
        tail = self.tokenizer.decode(tokens[self.anchor:end])
        if end - self.anchor >= ANCHOR_TOKENS and not tail.endswith("\ufffd"):
            self.head, self.anchor = self.head + tail, end
            return self.head
        return self.head + tail
