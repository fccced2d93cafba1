"""Text and tokens on the embedded server: POST /tokenize, /detokenize, and the prompts of /v1/completions
(a string, strings, token ids or lists of them), with the served model's tokenizer."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P
from asyncgrpo.server.routes.common import RouteTable, read_body
from asyncgrpo.server.routes.models import ModelNames


class TextCodec:
    """The served model's tokenizer (None: the model has none, requests send token ids) as routes use it."""

    def __init__(self, tokenizer: Any, spec: P.ServerSpec) -> None:
        self.tokenizer = tokenizer
        self.spec = spec

    def required(self) -> Any:
        if self.tokenizer is None:
            raise P.ApiError(400, "this model has no tokenizer; send token ids")
        return self.tokenizer

    def encode(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            raise P.ApiError(400, "prompt must be a string", param="prompt")
        return list(self.required()(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def prompts(self, prompt: Any) -> list[list[int]]:
        """str | list[int] | list[str] | list[list[int]] -> token-id prompts (none of them empty)."""
        texts_given = isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
        if isinstance(prompt, str) or texts_given:
            texts = [prompt] if isinstance(prompt, str) else prompt
            prompts = [self.encode(p) for p in texts]
            for i, ids in enumerate(prompts):
                if not ids:  # nothing to condition on: vLLM refuses it too
                    where = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
                    raise P.ApiError(400, f"{where} is empty (it encodes to no token); send some text",
                                     param="prompt")
            return prompts
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [P.token_id_list(p, self.spec, "prompt") for p in prompt]
        return [P.token_id_list(prompt, self.spec, "prompt")]


class TextRoutes(RouteTable):
    """POST /tokenize {"prompt", "add_special_tokens"}, /detokenize {"tokens"} (either may name `model`)."""

    ROUTES = (("POST", "/tokenize", "tokenize"), ("POST", "/detokenize", "detokenize"))

    def __init__(self, text: TextCodec, names: ModelNames) -> None:
        self.text = text
        self.names = names

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        self.names.resolve(body.get("model"))
        ids = self.text.encode(body.get("prompt"), bool(body.get("add_special_tokens", True)))
        return web.json_response({"count": len(ids), "max_model_len": self.text.spec.max_model_len,
                                  "tokens": ids, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        self.names.resolve(body.get("model"))
        ids = P.token_id_list(body.get("tokens"), self.text.spec, "tokens")
        return web.json_response({"prompt": self.text.required().decode(ids)})
