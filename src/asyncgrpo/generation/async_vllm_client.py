"""TRL 1.18's `trl.generation.async_vllm_client`: `AsyncVLLMClient` is this package's one asynchronous
client of the inference server (vLLM or the embedded server), `GenerationClient`."""

from asyncgrpo.generation.client import GenerationClient as AsyncVLLMClient

__all__ = ["AsyncVLLMClient"]
