"""Talking to the inference server (vLLM or the embedded server).

protocol.py     pure: request bodies and response parsers (SamplingParams, TurnOutput)
server_info.py  pure: what the server says about itself (ServerInfo, ServerMetrics, /server_info, /metrics)
transport.py    ServerTransport: the aiohttp session, the retry mechanism, its errors, /health polling
client.py       GenerationClient: the only HTTP client of the project (the routes, retried per call kind)
"""

from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.protocol import ProtocolError, SamplingParams, TurnOutput, VersionSpan
from asyncgrpo.generation.server_info import ServerInfo, ServerMetrics
from asyncgrpo.generation.transport import ServerConnectionError, ServerRequestError

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
