"""The messages' base: requests, replies, the names and block keys they carry, and the one error format."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from ..blocks import KEY_BYTES

MAX_KEYS = 65536  # block keys in one control request

Name = Annotated[str, Field(min_length=1, pattern=r"^[^/]+$")]  # tenants, nodes, tiers: parts of etcd keys
_HEX = r"([0-9a-f]{2}){1,64}"
KeyHex = Annotated[str, Field(pattern=f"^{_HEX}$")]
BlockSizeValue = Annotated[int, Field(ge=0, lt=1 << 32)]  # bytes; the index keeps 32 bits


def _joined_hex(keys: list) -> bytes:
    if not all(isinstance(h, str) and re.fullmatch(_HEX, h) for h in keys):
        raise ValueError("block keys: a list of hex strings, or base64 of 32-byte keys back to back")
    return b"".join(bytes.fromhex(h) for h in keys)


def _from_hex_list(value: object) -> object:
    """The previous release's form: a list of hex keys, joined into one string of raw keys."""
    return _joined_hex(value) if isinstance(value, list) else value


def packed_from_hex(keys: list[str]) -> bytes:
    """Hex block keys (the previous release's form) as one string of raw keys, checked as
    ``PackedKeys`` is; ``ValueError`` otherwise."""
    return _whole_keys(_joined_hex(keys))


def _whole_keys(raw: bytes) -> bytes:
    if len(raw) % KEY_BYTES:
        raise ValueError(f"block keys are {KEY_BYTES} bytes each, got {len(raw)} bytes in all")
    if len(raw) > MAX_KEYS * KEY_BYTES:
        raise ValueError(f"at most {MAX_KEYS} keys in one request")
    return raw


# Block keys in a control request: their 32-byte keys back to back, base64 (one string, so a report
# of thousands of blocks is parsed in a fraction of a millisecond, not as an object per block), or a
# list of hex keys (the previous release's form, taken during a rolling upgrade). Validated, it is
# the raw keys; a key of another length, or more than ``MAX_KEYS``, is refused.
PackedKeys = Annotated[bytes, BeforeValidator(_from_hex_list), AfterValidator(_whole_keys)]


# The control API's version: 2 numbers it (``/health`` says it) and adds ``MemberInfo.ADDED``'s fields.
# A conductor takes members of its release and the one before; a member of this release registers
# with a conductor of the one before too (without the fields it would refuse).
CONTROL_API = 2


class Request(BaseModel):
    """A message a server validates: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, val_json_bytes="base64", ser_json_bytes="base64")


class Reply(BaseModel):
    """A message a client reads: unknown fields are ignored (newer servers may add some)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, val_json_bytes="base64", ser_json_bytes="base64")


class ErrorInfo(Reply):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    leader: str | None = Field(default=None, description="a follower's answer to a write: the leader's URL")
    retryable: bool = Field(default=False, description="the same request may succeed if sent again")


class ErrorReply(Reply):
    """OpenAI's error body, used by the front, the control API and the workers alike."""

    error: ErrorInfo
