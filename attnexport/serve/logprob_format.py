"""Log-probabilities in the response shapes clients read: OpenAI's completions (legacy:
parallel lists of tokens, their log-probabilities, the top tokens as ``{text: logprob}`` and
text offsets), OpenAI's chat (``content``: one object per token, with its UTF-8 bytes), and
vLLM's ``prompt_logprobs`` (``{token id: {logprob, rank, decoded_token}}`` per prompt token).

A token's text is its decode alone with special tokens kept (``<|im_end|>`` shows as itself; a
byte-level token that is part of a character shows as U+FFFD, and its ``bytes`` say which);
without a tokenizer it is ``token_id:N`` (vLLM's ``--return-tokens-as-token-ids``)."""

from __future__ import annotations

from collections.abc import Sequence

from attnexport.runtime.logprobs import TokenLogprobs
from attnexport.runtime.text import Tokenizer
from attnexport.serve.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)


class TokenTexts:
    """Token id -> its text, decoded once per id."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token}"
            else:
                text = self.tokenizer.hf.decode([token], skip_special_tokens=False)
            self._texts[token] = text
        return text


def completion_logprobs(
    entries: Sequence[TokenLogprobs | None],
    token_ids: Sequence[int],
    texts: TokenTexts,
    offset: int = 0,
) -> CompletionLogprobs:
    """OpenAI's completions ``logprobs`` of ``token_ids`` (an entry per token; None for the
    first prompt token, which nothing predicts), offsets counted from ``offset``."""
    out = CompletionLogprobs()
    for token, entry in zip(token_ids, entries, strict=True):
        text = texts(token)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.logprob)
        top = {texts(i): value for i, value in zip(entry.top_ids, entry.top_logprobs, strict=True)}
        top.setdefault(text, entry.logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: TokenTexts) -> ChatLogprobs:
    """OpenAI's chat ``logprobs`` of generated tokens."""
    content = []
    for entry in entries:
        text = texts(entry.token_id)
        top = [
            TopLogprob(token=texts(i), logprob=value, bytes=_bytes(texts(i)))
            for i, value in zip(entry.top_ids, entry.top_logprobs, strict=True)
        ]
        content.append(
            TokenLogprob(token=text, logprob=entry.logprob, bytes=_bytes(text), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


def prompt_logprobs(entries: Sequence[TokenLogprobs | None], texts: TokenTexts) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or ``{id: {logprob,
    rank, decoded_token}}`` holding the token and its row's most likely tokens."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        tops = {
            str(i): PromptLogprob(logprob=value, rank=rank, decoded_token=texts(i))
            for rank, (i, value) in enumerate(
                zip(entry.top_ids, entry.top_logprobs, strict=True), start=1
            )
        }
        tops[str(entry.token_id)] = PromptLogprob(
            logprob=entry.logprob, rank=entry.rank, decoded_token=texts(entry.token_id)
        )
        out.append(tops)
    return out


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
