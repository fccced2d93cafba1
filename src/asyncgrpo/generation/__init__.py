"""Talking to the inference server (vLLM or the embedded server).

protocol.py  pure: request bodies, response parsers, SamplingParams / TurnOutput / ServerInfo
client.py    GenerationClient: the only HTTP client of the project (aiohttp, async, retries)
"""

from asyncgrpo.generation.client import GenerationClient, ServerConnectionError, ServerRequestError
from asyncgrpo.generation.protocol import (
    ProtocolError,
    SamplingParams,
    ServerInfo,
    ServerMetrics,
    TurnOutput,
    VersionSpan,
)

__all__ = [
    "GenerationClient",
    "ProtocolError",
    "SamplingParams",
    "ServerConnectionError",
    "ServerInfo",
    "ServerMetrics",
    "ServerRequestError",
    "TurnOutput",
    "VersionSpan",
]
