"""Talking to the inference server (vLLM or the embedded server).

protocol.py     pure: request bodies and response parsers (SamplingParams, TurnOutput)
server_info.py  pure: what the server says about itself (ServerInfo, ServerMetrics, /server_info, /metrics)
client.py       GenerationClient: the only HTTP client of the project (aiohttp, async, retries)
"""

from asyncgrpo.generation.client import GenerationClient, ServerConnectionError, ServerRequestError
from asyncgrpo.generation.protocol import ProtocolError, SamplingParams, TurnOutput, VersionSpan
from asyncgrpo.generation.server_info import ServerInfo, ServerMetrics

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
