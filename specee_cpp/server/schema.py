"""Request bodies of the OpenAI HTTP API, as far as specee-cpp serves them.

Fields a standard client sends and we honour are typed (a wrong type is a 400 naming the
field); fields we do not know are ignored, as OpenAI-compatible servers do; fields we know
but cannot honour (penalties, logprobs, tools, n > 1) are refused when set to anything but
their neutral value, since a silently ignored option misleads.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator


class Extra(BaseModel):
    """Our own per-request settings, in the body field ``specee`` (clients: ``extra_body``)."""

    model_config = ConfigDict(extra="forbid")

    mode: Optional[str] = None                       # default: the server's --mode
    # spec: a number or auto/stop/pmin/hf/speckv (strict: JSON true is no number of tokens)
    gamma: Optional[Union[StrictInt, StrictStr]] = None
    ignore_eos: bool = False                          # run to max_tokens (load tests)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class PredictedOutput(BaseModel):
    """OpenAI's Predicted Outputs: text the reply is expected to repeat for the most part
    (an edit's original), drafted and verified, so greedy output is unchanged."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None     # one model is served; any name is accepted
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)        # llama.cpp servers' extension
    seed: Optional[int] = Field(None, ge=0)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: Union[bool, int, None] = None
    logit_bias: Optional[dict] = None
    prediction: Optional[PredictedOutput] = None
    specee: Optional[Extra] = None

    @model_validator(mode="after")
    def _supported(self):
        unsupported = {"n": self.n != 1,
                       "frequency_penalty": self.frequency_penalty != 0,
                       "presence_penalty": self.presence_penalty != 0,
                       "logprobs": bool(self.logprobs),
                       "logit_bias": bool(self.logit_bias)}
        for name, set_ in unsupported.items():
            if set_:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by "
                                 f"specee-cpp (leave it unset)")
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)   # the newer name of max_tokens
    tools: Optional[list] = None
    response_format: Optional[dict] = None

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.tools:
            raise ValueError("tools are not supported by specee-cpp")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} is not "
                             f"supported by specee-cpp (only text)")
        return self

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: Union[str, list[str]]
    echo: bool = False
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError(f"prompt: one prompt per request is supported, got "
                             f"{len(self.prompt)}")
        if self.echo or self.suffix:
            raise ValueError("echo and suffix are not supported by specee-cpp")
        return self

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def limit(self) -> Optional[int]:
        return self.max_tokens
