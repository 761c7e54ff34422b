"""Request bodies the dev engine accepts, and the error it answers with.

The models follow vLLM's OpenAI-compatible protocol: unknown fields are accepted and ignored (as vLLM
does), while fields that would change what is sampled in a way the dev engine cannot honour (penalties,
top-p/top-k, logit bias, guided decoding, forced tool choice, ``n > 1``) are refused with a 400 that says
so, rather than silently sampling from a different distribution than the one the logprobs describe.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ERROR_KINDS = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 503: "ServiceUnavailable"}


class EngineError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = ERROR_KINDS.get(self.status, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_script: bool = False
    """A scripted engine samples this request instead of handing it the script's next reply (the
    launcher's behavioural probes, :mod:`harness_trainer.launch.probes`, must not eat a script's replies);
    no effect on an engine that is not scripted. vLLM ignores the field."""

    @model_validator(mode="after")
    def _refuse_what_is_not_sampled(self) -> SamplingFields:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported: the dev engine returns exactly one choice (n=1)")
        unsupported = {
            "top_p": self.top_p not in (None, 1.0),
            "top_k": self.top_k not in (None, 0, -1),
            "min_p": self.min_p not in (None, 0.0),
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "logit_bias": bool(self.logit_bias),
        }
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
            unsupported[name] = getattr(self, name, None) is not None
        refused = [name for name, bad in unsupported.items() if bad]
        if refused:
            raise ValueError(
                f"not supported by the dev engine: {', '.join(refused)} (it samples from the full "
                "distribution at the given temperature only)"
            )
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_forced_output(self) -> ChatCompletionRequest:
        if self.tool_choice == "required" or isinstance(self.tool_choice, dict):
            raise ValueError("forced tool_choice needs guided decoding, which the dev engine does not do")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("response_format other than text needs guided decoding (not in the dev engine)")
        return self

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    """``POST /v1/completions`` with a string or a token-id prompt."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            raise ValueError("token ids must be non-negative")
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _no_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by the dev engine")
        return self


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a text prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]
