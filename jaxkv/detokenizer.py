"""Incremental detokenization and stop-string matching (engine level, as in vLLM).

The core stops on token ids; stop *strings* need text, so the engine checks them here after
each step and finishes the request itself.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Keeps the decoded text of one completion and finds stop strings in new text.

    ``tokenizer`` needs ``decode(ids, skip_special_tokens=...) -> str``. Decoding the whole
    output each step is quadratic in its length, but exact for byte-level BPE (a UTF-8
    character split across tokens is only emitted once complete).
    """

    def __init__(
        self,
        tokenizer,
        *,
        stop: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends tokens; returns the stop string that matched, if any (text is then cut)."""
        if not new_token_ids:
            return None
        prev_len = len(self.text)
        self.token_ids.extend(new_token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        # Hold back a trailing replacement char: the next token may complete the character.
        self.text = text[:-1] if text.endswith("\ufffd") else text
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(prev_len - longest + 1, 0)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s
