"""OpenAI's requests as this server takes them (completion and chat: strict types, unknown fields
refused, parameters it does not honour accepted only at their neutral value), the shapes of a
response, and the ``Stopper`` that ends an answer at a stop string. Text becomes tokens and tokens
text through the served model's tokenizer (``tiercake.tokenizer``)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tiercake.messages import TokenEvent
from tiercake.tokenizer import Detokenizer, Tokenizer


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


MAX_CHOICES = 16  # answers in one response (prompts times n): each is a request to a worker
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default limit
MAX_STOP_TOKEN_IDS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    include_usage: bool = False


class _OpenAIRequest(BaseModel):
    """What OpenAI's completion and chat requests share. Unknown fields are refused (as OpenAI does);
    types are strict (a ``"16"``, ``2.0`` or ``true`` where an integer belongs is a 400, never
    coerced); the parameters in a request's ``UNHONOURED`` are accepted only at their neutral value:
    clients that send them at that value are served, any other value is a 400 that names the
    parameter, never an answer that silently ignored it."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    UNHONOURED: ClassVar[dict[str, Any]] = {}

    model: str = Field(min_length=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(
        default=None,
        ge=-(2**63),
        le=2**64 - 1 - MAX_CHOICES,
        description="a 64-bit integer (choice j samples with seed + j)",
    )
    user: str | None = Field(
        default=None, description="the caller's end user: the session, when no header and no prompt_cache_key name one"
    )
    prompt_cache_key: str | None = Field(
        default=None, description="OpenAI's cache key: the session, when no session header names one"
    )
    n: int = Field(
        default=1,
        ge=1,
        le=MAX_CHOICES,
        description="answers per prompt (choice i*n+j: prompt i's j-th); with a seed, choice j samples with seed+j",
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling")
    stop: str | list[str] | None = Field(
        default=None,
        description="up to 4 strings: the answer ends before the first one it would contain (finish_reason stop)",
    )
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(
        default=None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="vLLM's extension: token ids that end the answer "
        "(not included; at most 256, each in the vocabulary's range)",
    )
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

    UNHONOURED: ClassVar[dict[str, Any]] = {
        "best_of": 1,
        "echo": False,
        "suffix": None,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "logit_bias": None,
    }

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text or token ids (of the served model's tokenizer; bytes for the reference model), or a "
        "list of them: one answer each"
    )
    max_tokens: int = Field(default=16, ge=1)
    best_of: int = 1
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="each token's log-probability and this many most likely alternatives",
    )
    echo: bool = False
    suffix: str | None = None

    def prompts(self, tokenizer: Tokenizer) -> list[list[int]]:
        """The prompts as token ids, at most ``MAX_CHOICES`` answers in all."""
        p = self.prompt
        # one prompt (text or token ids), or a list of them (mypy cannot narrow a union by its first item)
        many = cast("list[str | list[int]]", [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p))
        if not many:
            raise ValueError("the prompt list is empty")
        if len(many) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(many)} prompts x n {self.n} answers: at most {MAX_CHOICES} in one request")
        return [tokenizer.encode(q) if isinstance(q, str) else q for q in many]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_OpenAIRequest):
    """OpenAI's chat completion request; ``max_completion_tokens`` is the newer name of
    ``max_tokens`` (one of the two)."""

    UNHONOURED: ClassVar[dict[str, Any]] = {
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "logit_bias": None,
        "tools": None,
        "tool_choice": None,
        "response_format": None,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = Field(default=False, description="each answer token's log-probability")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="with logprobs: this many most likely alternatives per token"
    )
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def limit(self) -> int:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("send max_tokens or max_completion_tokens, not both")
        return self.max_completion_tokens or self.max_tokens or 16

    def alternatives(self) -> int | None:
        """How many alternatives per token (None: no log-probabilities), as OpenAI takes the pair."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionShape:
    """How ``/v1/completions`` renders an answer (legacy logprobs: parallel lists)."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    @staticmethod
    def choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def chunk_choice(index: int, text: str, finish: str | None, first: bool, logprobs: dict | None) -> dict:
        return CompletionShape.choice(index, text, finish, logprobs)

    @staticmethod
    def logprobs(events: list[TokenEvent], offsets: list[int], tok: Tokenizer) -> dict:
        return {
            "tokens": [tok.token_text(e.token) for e in events],
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{tok.token_text(a.token): a.logprob for a in e.top_logprobs or ()} for e in events],
            "text_offset": offsets,
        }


class ChatShape:
    """How ``/v1/chat/completions`` renders one: a message whole, deltas when streamed (the first
    names the role)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    @staticmethod
    def choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    @staticmethod
    def chunk_choice(index: int, text: str, finish: str | None, first: bool, logprobs: dict | None) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(events: list[TokenEvent], offsets: list[int], tok: Tokenizer) -> dict:
        def entry(token: int, logprob: float | None) -> dict:
            return {"token": tok.token_text(token), "logprob": logprob, "bytes": tok.token_bytes(token)}

        return {
            "content": [
                entry(e.token, e.logprob) | {"top_logprobs": [entry(a.token, a.logprob) for a in e.top_logprobs or ()]}
                for e in events
            ]
        }


class Stopper:
    """The answer's tokens as text, ended at the first stop string (left out) or stop token id; text
    that may still be the start of a stop string is held back until it cannot be (a stream never
    shows the beginning of a stop string it then cuts)."""

    def __init__(self, stops: list[str], stop_ids: frozenset[int], detokenizer: Detokenizer) -> None:
        self.decoder = detokenizer
        self.stops, self.stop_ids = stops, stop_ids
        self.pending = ""
        self.stopped = False
        self.decoded = 0  # characters decoded so far, shown or held back (where the next token's text begins)

    def feed(self, token: int) -> str:
        """The text ``token`` makes safe to show ('' while held back); ``stopped`` once it ended."""
        if token in self.stop_ids:  # what came before it shows as it would have (a cut character as U+FFFD)
            self.stopped = True
            return self.rest()
        piece = self.decoder.feed(token)
        self.decoded += len(piece)
        self.pending += piece
        hits = [self.pending.find(s) for s in self.stops if s in self.pending]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out

    def rest(self) -> str:
        """At the end of the answer: what was held back and never became a stop."""
        out, self.pending = self.pending + self.decoder.rest(), ""
        return out
