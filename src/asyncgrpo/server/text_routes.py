"""Text and tokens on the embedded server: /tokenize, /detokenize and the prompts of /v1/completions
(a string, strings, token ids or lists of them), with the served model's tokenizer.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from asyncgrpo.server import protocol as P


class TextRoutes:
    """Mixed into the server (`app.Server`): reads its `served`, `spec`, `_body`, `resolve_model`."""

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.resolve_model(body.get("model"))
        ids = self._encode(body.get("prompt"), bool(body.get("add_special_tokens", True)))
        return web.json_response(
            {"count": len(ids), "max_model_len": self.spec.max_model_len, "tokens": ids, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.resolve_model(body.get("model"))
        ids = P.token_id_list(body.get("tokens"), self.spec, "tokens")
        return web.json_response({"prompt": self._tokenizer().decode(ids)})

    def _tokenizer(self):
        if self.served.tokenizer is None:
            raise P.ApiError(400, "this model has no tokenizer; send token ids")
        return self.served.tokenizer

    def _encode(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            raise P.ApiError(400, "prompt must be a string", param="prompt")
        return list(self._tokenizer()(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """str | list[int] | list[str] | list[list[int]] -> token-id prompts (none of them empty)."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            prompts = [self._encode(p) for p in texts]
            for i, ids in enumerate(prompts):
                if not ids:  # nothing to condition on: vLLM refuses it too
                    where = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
                    raise P.ApiError(400, f"{where} is empty (it encodes to no token); send some text", param="prompt")
            return prompts
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [P.token_id_list(p, self.spec, "prompt") for p in prompt]
        return [P.token_id_list(prompt, self.spec, "prompt")]
