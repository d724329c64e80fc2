"""OpenAI's requests as this server takes them (completion and chat: strict types, unknown fields
refused, parameters it does not honour accepted only at their neutral value), the reference model's
chat template, and the shapes of a response. The template turns a conversation into one prompt; a
follow-up turn's prompt extends the previous one's, so the conversation's KV is reused turn after
turn (the pattern of the trace)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


def stop_strings(value: str | list[str] | None) -> list[str]:
    """``stop`` as a list: at most 4 non-empty strings, as OpenAI takes them."""
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ValueError("stop takes at most 4 non-empty strings")
    return stops


def only_neutral(unhonoured: dict, value, info: ValidationInfo):
    """A parameter this server does not honour passes only at the value that means "not used"."""
    neutral = unhonoured[info.field_name]
    if value != neutral and not (neutral is None and value in ([], {}, "")):
        raise ValueError(f"{value!r} is not supported by this server (leave it out, or send {neutral!r})")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _OpenAIRequest(BaseModel):
    """What OpenAI's completion and chat requests share. Unknown fields are refused (as OpenAI does);
    types are strict (a ``"16"``, ``2.0`` or ``true`` where an integer belongs is a 400, never
    coerced); the parameters in a request's ``UNHONOURED`` are accepted only at their neutral value:
    clients that send them at that value are served, any other value is a 400 that names the
    parameter, never an answer that silently ignored it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    UNHONOURED: ClassVar[dict[str, Any]] = {}

    model: str = Field(min_length=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = Field(default=None, description="the caller's end user, for their logs: accepted, unused")
    n: int = 1
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling")
    stop: str | list[str] | None = Field(default=None, description="up to 4 strings: the answer ends before the "
                                         "first one it would contain (finish_reason stop)")
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM's extension: token ids that end "
                                             "the answer (not included)")
    presence_penalty: float = 0
    frequency_penalty: float = 0
    logit_bias: dict[str, float] | None = None

    @field_validator("*")
    @classmethod
    def _only_neutral(cls, value, info: ValidationInfo):
        return only_neutral(cls.UNHONOURED, value, info) if info.field_name in cls.UNHONOURED else value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stop_strings(value)
        return value


class CompletionRequest(_OpenAIRequest):
    """OpenAI's completion request."""

    UNHONOURED: ClassVar[dict[str, Any]] = {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "suffix": None,
                                            "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None}

    prompt: str | list[int] = Field(description="text, or token ids (bytes for the reference model)")
    max_tokens: int = Field(default=16, ge=1)
    best_of: int = 1
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_OpenAIRequest):
    """OpenAI's chat completion request; ``max_completion_tokens`` is the newer name of
    ``max_tokens`` (one of the two)."""

    UNHONOURED: ClassVar[dict[str, Any]] = {"n": 1, "logprobs": False, "top_logprobs": None, "presence_penalty": 0,
                                            "frequency_penalty": 0, "logit_bias": None, "tools": None,
                                            "tool_choice": None, "response_format": None}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def limit(self) -> int:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("send max_tokens or max_completion_tokens, not both")
        return self.max_completion_tokens or self.max_tokens or 16


def render(messages: list[ChatMessage]) -> str:
    """The reference model's chat template: each message as ``<|role|>\\n{content}\\n``, then
    ``<|assistant|>\\n`` for the answer. Documented in the README; its bytes are the prompt."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


class CompletionShape:
    """How ``/v1/completions`` renders an answer."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    @staticmethod
    def choice(text: str, finish: str | None) -> dict:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}

    @staticmethod
    def chunk_choice(text: str, finish: str | None, first: bool) -> dict:
        return CompletionShape.choice(text, finish)


class ChatShape:
    """How ``/v1/chat/completions`` renders one: a message whole, deltas when streamed (the first
    names the role)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    @staticmethod
    def choice(text: str, finish: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    @staticmethod
    def chunk_choice(text: str, finish: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


class Stopper:
    """The answer's tokens as text, ended at the first stop string (left out) or stop token id; text
    that may still be the start of a stop string is held back until it cannot be (a stream never
    shows the beginning of a stop string it then cuts)."""

    def __init__(self, stops: list[str], stop_ids: frozenset[int]) -> None:
        import codecs

        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stops, self.stop_ids = stops, stop_ids
        self.pending = ""
        self.stopped = False

    def feed(self, token: int) -> str:
        """The text ``token`` makes safe to show ('' while held back); ``stopped`` once it ended."""
        if token in self.stop_ids:  # what came before it shows as it would have (a cut UTF-8 sequence as U+FFFD)
            self.stopped = True
            return self.rest()
        self.pending += self.decoder.decode(bytes([token % 256]))
        hits = [self.pending.find(s) for s in self.stops if s in self.pending]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out

    def rest(self) -> str:
        """At the end of the answer: what was held back and never became a stop."""
        out, self.pending = self.pending + self.decoder.decode(b"", final=True), ""
        return out
