"""vLLM 0.33's OpenAI dialect, field for field: request models, response bodies, SSE chunks, errors.

Bodies are plain dicts built in vLLM's key order (``model_dump()`` keeps every null field; stream
chunks are ``model_dump_json(exclude_unset=True)``, so only the fields vLLM sets appear). See the
recorded exchanges in ``tests/fixtures/wire`` / ``shared/wire``.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from starlette.responses import JSONResponse

from acelora.errors import describe_validation_error

# sanitize_message: absolute paths under these roots, and file names with a file extension
_ROOTS = "home|usr|opt|var|tmp|root|lib|mnt|srv"
_PATH = re.compile(
    rf"/(?:{_ROOTS})(?:/[^\s'\"`,;]*)?|[\w./-]*\.(?:json|safetensors|bin|pt|pth|py|txt|ya?ml|toml|gguf)\b"
)


def redact(message: str) -> str:
    """Replace filesystem paths in an error message with ``<path>``, as vLLM's ``sanitize_message``.

    >>> redact("No adapter found for /tmp/adapters/x")
    'No adapter found for <path>'
    """
    return _PATH.sub("<path>", message)


def error(status: int, message: str, err_type: str, param: str | None = None) -> JSONResponse:
    """vLLM's error envelope ``{"error": {"message", "type", "param", "code"}}``.

    >>> error(404, "The lora adapter 'x' cannot be found.", "NotFoundError").status_code
    404
    """
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def validation_error(exc: ValidationError) -> JSONResponse:
    """A pydantic failure on a request body as vLLM's 400 ``BadRequestError``."""
    where, msg = describe_validation_error(exc)
    return error(400, f"{where}: {msg}" if where else msg, "BadRequestError", where or None)


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event line as vLLM writes it (compact JSON, blank line after)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def request_id(prefix: str) -> str:
    """A response id as vLLM shapes it: prefix and 16 hex digits.

    >>> request_id("chatcmpl").startswith("chatcmpl-")
    True
    """
    return f"{prefix}-{secrets.token_hex(8)}"


# -- requests ------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM ignores fields it does not know


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds the final usage chunk."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    lora_prefetch: Any = None  # acelora hint: registered adapters to pre-load (anything else is ignored)
    # Asked-for log probabilities cannot be silently dropped: refuse them (this engine returns none).
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None

    @field_validator("logprobs", "top_logprobs", "prompt_logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("log probabilities are not supported by this engine")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or any(len(s) > 256 for s in stops):
            raise ValueError("at most 16 stop strings of at most 256 characters each")
        return v

    def stop_list(self) -> tuple[str, ...]:
        """``stop`` as a tuple of strings."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        """True when a stream should end with the usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class TextPart(_Body):
    """A ``{"type": "text", "text": ...}`` content part (the only kind a text model takes)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat message; ``content`` is a string or a list of text parts.

    >>> ChatMessage(role="user", content=[{"type": "text", "text": "hi"}]).text()
    'hi'
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The message's text (parts joined)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions`` (the fields this engine honours; others are accepted and ignored).

    >>> ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]}).n
    1
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` with one prompt (a string, a one-string list, or token ids).

    >>> CompletionRequest.model_validate({"prompt": "Once"}).prompt
    'Once'
    """

    prompt: str | list[str] | list[StrictInt]  # StrictInt: true/1.0 are not token ids
    echo: Literal[False] | None = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str] | list[StrictInt]) -> str | list[str] | list[StrictInt]:
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("exactly one prompt per request")
        if v == "" or v == []:
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return v


class LoadLoRAAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter`` body.

    >>> LoadLoRAAdapterRequest(lora_name="x-v1", lora_path="/adapters/x-v1").load_inplace
    False
    """

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter`` body.

    >>> UnloadLoRAAdapterRequest(lora_name="x-v1").lora_name
    'x-v1'
    """

    lora_name: str = ""
    lora_int_id: int | None = None


# -- responses -----------------------------------------------------------------------------------


def usage(prompt: int, completion: int, details: bool = True) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` (key order prompt, total, completion; details dropped in stream chunks).

    >>> usage(3, 2, details=False)
    {'prompt_tokens': 3, 'total_tokens': 5, 'completion_tokens': 2}
    """
    u: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details:
        u.update(prompt_tokens_details=None, completion_tokens_details=None)
    return u


def chat_response(
    rid: str,
    model: str,
    text: str,
    finish: str,
    stop_reason: Any,
    prompt: int,
    completion: int,
    fingerprint: str,
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` body with every null field vLLM keeps.

    >>> chat_response("chatcmpl-1", "med-qa-v1", "[med] hi", "stop", None, 5, 3, "fp")["object"]
    'chat.completion'
    """
    message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
               "function_call": None, "reasoning": None}  # fmt: skip
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
              "token_ids": None, "routed_experts": None, "weight_versions": None}  # fmt: skip
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": [choice],
        "service_tier": None, "system_fingerprint": fingerprint, "usage": usage(prompt, completion),
        "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
        "ec_transfer_params": None, "metrics": None,
    }  # fmt: skip


def completion_response(
    rid: str,
    model: str,
    text: str,
    finish: str,
    stop_reason: Any,
    prompt: int,
    completion: int,
    fingerprint: str,
) -> dict[str, Any]:
    """A non-streaming ``text_completion`` body.

    >>> completion_response("cmpl-1", "med-qa-v1", "[med] hi", "stop", None, 5, 3, "fp")["choices"][0]["text"]
    '[med] hi'
    """
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
              "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}  # fmt: skip
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice],
        "service_tier": None, "system_fingerprint": fingerprint, "usage": usage(prompt, completion),
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }  # fmt: skip


class ChunkWriter:
    """Builds one request's SSE chunks (chat or text completion) in vLLM's exact shapes.

    >>> w = ChunkWriter("chat", "chatcmpl-1", "code-python-v2", "fp", include_usage=False)
    >>> w.content("def").decode().startswith('data: {"id":"chatcmpl-1","object":"chat.completion.chunk"')
    True
    """

    def __init__(
        self, kind: Literal["chat", "text"], rid: str, model: str, fingerprint: str, include_usage: bool
    ):
        self.kind, self.rid, self.model, self.fp, self.include_usage = (
            kind,
            rid,
            model,
            fingerprint,
            include_usage,
        )
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _head(self) -> dict[str, Any]:
        return {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model}

    def role(self) -> bytes:
        """The first chat chunk: the assistant role with empty content."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return sse({**self._head(), "choices": [choice], "prompt_token_ids": None, "prompt_text": None})

    def content(self, text: str) -> bytes:
        """A chunk carrying a piece of generated text."""
        if self.kind == "chat":
            choice = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": None,
            }
            return sse({**self._head(), "choices": [choice], "kv_transfer_params": None})
        return sse({**self._head(), "choices": [self._text_choice(text, None, None)]})

    def finish(self, text: str, reason: str, stop_reason: Any) -> bytes:
        """The chunk with ``finish_reason`` (and the fingerprint when no usage chunk follows)."""
        if self.kind == "chat":
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason,
                      "stop_reason": stop_reason, "token_ids": None, "weight_versions": None}  # fmt: skip
            body = {**self._head(), "choices": [choice], "kv_transfer_params": None}
        else:
            body = {**self._head(), "choices": [self._text_choice(text, reason, stop_reason)]}
        if not self.include_usage:
            body["system_fingerprint"] = self.fp
        return sse(body)

    def usage(self, prompt: int, completion: int) -> bytes:
        """The final usage chunk (``choices: []``, nulls dropped)."""
        return sse({**self._head(), "choices": [], "usage": usage(prompt, completion, details=False),
                    "system_fingerprint": self.fp})  # fmt: skip

    def _text_choice(self, text: str, reason: str | None, stop_reason: Any) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": stop_reason,
                "prompt_token_ids": None, "token_ids": None}  # fmt: skip


def model_card(model_id: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
    """One ``/v1/models`` entry (vLLM's ``ModelCard`` with its single ``ModelPermission``)."""
    now = int(time.time())
    permission = {
        "id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission", "created": now,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
        "group": None, "is_blocking": False,
    }  # fmt: skip
    return {"id": model_id, "object": "model", "created": now, "owned_by": "vllm", "root": root, "parent": parent,
            "max_model_len": max_model_len, "permission": [permission]}  # fmt: skip
