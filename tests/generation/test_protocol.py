"""The protocol parsers against real vLLM 0.33 bodies (`tests/fixtures/vllm`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from asyncgrpo.generation.protocol import (
    ProtocolError,
    SamplingParams,
    VersionSpan,
    build_completions_request,
    build_generate_request,
    error_message,
    parse_completions_response,
    parse_generate_response,
)
from asyncgrpo.generation.server_info import (
    parse_metrics,
    parse_models,
    parse_server_info,
    parse_version,
    parse_world_size,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


@pytest.fixture(scope="module")
def cases() -> dict:
    path = FIXTURES / "protocol-0.33.0.json"
    assert path.exists(), f"vLLM fixtures not found at {path}"
    return json.loads(path.read_text())


def _stream_events(text: str) -> list[dict]:
    """Decode an SSE body into its JSON events (plain reference decoding for the fixture)."""
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            events.append(json.loads(block[len("data: ") :]))
    return events


def test_server_description_fixtures(cases):
    assert parse_version(cases["version"]["response"]) == ("0.33.0", (0, 33, 0))
    assert parse_version({"version": "0.33.0+embedded"}) == ("0.33.0+embedded", (0, 33, 0))
    assert parse_models(cases["models"]["response"]) == ("MODEL_DIR", 1024)
    cfg = parse_server_info(cases["server_info"]["response"])
    assert cfg.max_model_len == 1024
    assert cfg.dtype == "bfloat16"
    assert cfg.logprobs_mode == "processed_logprobs"
    assert cfg.return_sampling_mask is True
    assert cfg.kv_cache_tokens == 21653472
    assert parse_world_size(cases["get_world_size"]["response"]) == 1


def test_server_info_kv_tokens_fall_back_to_blocks(cases):
    body = json.loads(json.dumps(cases["server_info"]["response"]))
    del body["vllm_config"]["cache_config"]["kv_cache_size_tokens"]
    assert parse_server_info(body).kv_cache_tokens == 1353342 * 16


def test_models_prefers_base_card_over_lora():
    body = {
        "data": [
            {"id": "adapter", "parent": "base", "max_model_len": None},
            {"id": "base", "parent": None, "max_model_len": 64},
        ]
    }
    assert parse_models(body) == ("base", 64)


def test_generate_fixture_logprobs_and_top_k(cases):
    case = cases["generate"]
    k = case["request"]["sampling_params"]["logprobs"]
    out = parse_generate_response(case["response"], num_top_logprobs=k)
    choice = case["response"]["choices"][0]
    assert out.token_ids == choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert out.logprobs == [e["logprob"] for e in content]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.weight_versions == [VersionSpan("default", 0, 8)]
    assert out.request_id == case["response"]["request_id"]
    assert out.sampling_mask == choice["sampling_mask"]
    assert all(row == sorted(row) for row in out.sampling_mask)
    for i, entry in enumerate(content):
        top = out.top_logprobs[i]
        # reference: the entries with vocabulary rank 1..k
        expected = {
            t["token_id"]: t["logprob"]
            for t in entry["top_logprobs"]
            if t["rank"] is not None and t["rank"] <= k
        }
        assert top == expected
        assert len(top) == k
    # position 0 sampled a token of rank 15: it is not part of the top-5
    assert content[0]["rank"] == 15 and content[0]["token_id"] not in out.top_logprobs[0]
    # position 2 sampled the rank-1 token: it is
    assert content[2]["rank"] == 1 and content[2]["token_id"] in out.top_logprobs[2]


def test_generate_fixture_n2_first_choice_and_text_mode(cases):
    for name, k in (("generate_model_rtids", 5), ("generate_text_mode", 0)):
        case = cases[name]
        out = parse_generate_response(case["response"], num_top_logprobs=k)
        choice = case["response"]["choices"][0]
        assert out.token_ids == choice["token_ids"]
        assert out.logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
    # text mode keys top log-probs by token text: only the sampled log-probs are usable
    with pytest.raises(ProtocolError, match="token_id"):
        parse_generate_response(cases["generate_text_mode"]["response"], num_top_logprobs=1)
    assert (
        parse_generate_response(cases["generate_text_mode"]["response"], num_top_logprobs=0).top_logprobs
        is None
    )


def test_generate_stream_fixture_matches_the_whole_response(cases):
    """The streamed chunks of the same seeded request concatenate to what the parser reads from the
    non-streaming body (reference decoding of the SSE text)."""
    events = _stream_events(cases["generate_stream"]["response"])
    choices = [e["choices"][0] for e in events if e["choices"]]
    streamed = [t for c in choices for t in c["token_ids"]]
    out = parse_generate_response(cases["generate"]["response"], num_top_logprobs=5)
    assert streamed == out.token_ids[: len(streamed)]
    assert [e["logprob"] for c in choices for e in c["logprobs"]["content"]] == out.logprobs[: len(streamed)]


def test_generate_missing_sampled_entry_and_sentinel():
    body = {
        "request_id": "generate-tokens-x",
        "choices": [
            {
                "token_ids": [5, 6, 7],
                "finish_reason": "stop",
                "stop_reason": 7,
                "sampling_mask": None,
                "weight_versions": [
                    {"version": "v1", "start": 0, "end": 2},
                    {"version": "v2", "start": 2, "end": 3},
                ],
                "logprobs": {
                    "content": [
                        {"token_id": 5, "logprob": -9999.0, "rank": None, "top_logprobs": []},
                        {
                            "token_id": 6,
                            "logprob": -0.5,
                            "rank": 1,
                            "top_logprobs": [
                                {"token_id": 6, "logprob": -0.5, "rank": 1},
                                {"token_id": 9, "logprob": -9999.0, "rank": 2},
                            ],
                        },
                        {
                            "token_id": 7,
                            "logprob": -3.0,
                            "rank": 4,
                            "top_logprobs": [
                                {"token_id": 7, "logprob": -3.0, "rank": 4},
                                {"token_id": 1, "logprob": -0.1, "rank": 1},
                                {"token_id": 2, "logprob": -0.2, "rank": 2},
                            ],
                        },
                    ]
                },
            }
        ],
    }
    out = parse_generate_response(body, num_top_logprobs=2)
    assert out.logprobs == [-math.inf, -0.5, -3.0]
    assert out.top_logprobs == [{}, {6: -0.5, 9: -math.inf}, {1: -0.1, 2: -0.2}]
    assert out.stop_reason == 7
    assert out.weight_versions == [VersionSpan("v1", 0, 2), VersionSpan("v2", 2, 3)]
    assert out.sampling_mask is None


def test_generate_old_dialect_token_strings():
    body = {
        "choices": [
            {
                "token_ids": [11],
                "logprobs": {
                    "content": [
                        {
                            "token": "token_id:11",
                            "logprob": -1.0,
                            "top_logprobs": [
                                {"token": "token_id:11", "logprob": -1.0},
                                {"token": "token_id:3", "logprob": -0.3},
                            ],
                        }
                    ]
                },
            }
        ]
    }
    out = parse_generate_response(body, num_top_logprobs=1)
    assert out.top_logprobs == [{3: -0.3}]
    assert out.weight_versions is None and out.finish_reason is None


def test_generate_length_mismatch_and_missing_logprobs_raise():
    body = {"choices": [{"token_ids": [1, 2], "logprobs": {"content": [{"token_id": 1, "logprob": -1.0}]}}]}
    with pytest.raises(ProtocolError, match="1 log-prob entries for 2 tokens"):
        parse_generate_response(body, num_top_logprobs=0)
    with pytest.raises(ProtocolError, match="requested"):
        parse_generate_response({"choices": [{"token_ids": [1], "logprobs": None}]}, num_top_logprobs=0)
    with pytest.raises(ProtocolError, match="no choices"):
        parse_generate_response({"choices": []}, num_top_logprobs=None)


def test_completions_fixture_string_keys_give_no_top_logprobs(cases):
    case = cases["completions_tokens"]
    out = parse_completions_response(case["response"], num_top_logprobs=5)
    choice = case["response"]["choices"][0]
    assert out.token_ids == choice["token_ids"]
    assert out.logprobs == choice["logprobs"]["token_logprobs"]
    assert out.top_logprobs is None  # keys are token texts, not "token_id:N"
    assert out.sampling_mask is None and out.weight_versions is None
    # the completions and generate routes sampled the same seeded tokens with the same log-probs
    gen = parse_generate_response(cases["generate"]["response"], num_top_logprobs=5)
    assert gen.token_ids == out.token_ids and gen.logprobs == out.logprobs
    text = parse_completions_response(cases["completions_text_prompt"]["response"], num_top_logprobs=2)
    assert text.token_ids == cases["completions_text_prompt"]["response"]["choices"][0]["token_ids"]


def test_completions_token_id_keys_are_mapped():
    body = {
        "id": "cmpl-1",
        "choices": [
            {
                "token_ids": None,
                "finish_reason": "length",
                "stop_reason": None,
                "weight_versions": [{"version": "default", "start": 0, "end": 2}],
                "logprobs": {
                    "tokens": ["token_id:4", "token_id:8"],
                    "token_logprobs": [-2.0, None],
                    "top_logprobs": [{"token_id:4": -2.0, "token_id:1": -0.5}, None],
                },
            }
        ],
    }
    out = parse_completions_response(body, num_top_logprobs=1)
    assert out.token_ids == [4, 8]
    assert out.logprobs == [-2.0, -math.inf]
    assert out.top_logprobs == [{1: -0.5}, {}]
    assert out.weight_versions == [VersionSpan("default", 0, 2)]


def test_completions_without_token_ids_is_an_error(cases):
    body = json.loads(json.dumps(cases["completion_while_paused"]["response"]))
    with pytest.raises(ProtocolError, match="return_token_ids"):
        parse_completions_response(body, num_top_logprobs=None)


def test_request_builders_send_every_sampling_field():
    params = SamplingParams(
        temperature=0.7, top_k=20, top_p=0.9, max_tokens=8, seed=3, logprobs=5, stop_token_ids=(2,)
    )
    body = build_generate_request([1, 2], params, dialect=(0, 33, 0), request_id="r1")
    assert body == {
        "token_ids": [1, 2],
        "sampling_params": {
            "temperature": 0.7,
            "top_k": 20,
            "top_p": 0.9,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "max_tokens": 8,
            "seed": 3,
            "logprobs": 5,
            "stop_token_ids": [2],
            "detokenize": False,  # token ids back: vLLM need not decode them
        },
        "output_mode": "tokens",
        "request_id": "r1",
    }
    assert "output_mode" not in build_generate_request([1], params, dialect=(0, 30, 0))
    comp = build_completions_request([1, 2, 3], SamplingParams(), model="m", max_model_len=10)
    assert comp["prompt"] == [1, 2, 3] and comp["model"] == "m"
    assert comp["max_tokens"] == 7  # not vLLM's default of 16
    assert comp["return_token_ids"] and comp["return_tokens_as_token_ids"]


def test_metrics_fixture_sums_engines():
    text = (FIXTURES / "metrics-0.33.0.txt").read_text()
    m = parse_metrics(text)
    assert (m.kv_cache_usage_frac, m.num_requests_running, m.num_requests_waiting, m.num_preemptions) == (
        0.0,
        0.0,
        0.0,
        0.0,
    )
    assert (m.generation_tokens, m.prompt_tokens) == (270391.0, 67656.0)  # vLLM 0.33's counters
    two = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
        "# TYPE vllm:num_preemptions_total counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0\n'
        'vllm:num_preemptions_total{engine="1",model_name="m"} 5.0\n'
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 100.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 20.0\n'
    )
    m = parse_metrics(two)
    assert (m.kv_cache_usage_frac, m.num_requests_running, m.num_requests_waiting, m.num_preemptions) == (
        0.75,
        7.0,
        None,
        7.0,
    )
    assert (m.generation_tokens, m.prompt_tokens) == (120.0, None)


def test_error_message_shapes(cases):
    assert error_message(json.dumps(cases["completion_while_paused_abort"]["response"])) == (
        "Generation is paused. Please retry after it resumes."
    )
    assert "InternalServerError" in error_message(
        json.dumps(cases["completions_greedy_INVALID_with_sampling_mask"]["response"])
    )
    assert error_message('{"error": "engine dead"}') == "engine dead"
    assert error_message('{"detail": "Not Found"}') == "Not Found"
    assert error_message("plain text") == "plain text"


def test_prefix_cache_counters_are_read_when_exported():
    assert parse_metrics((FIXTURES / "metrics-0.33.0.txt").read_text()).prefix_cache_queries is None
    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 360.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0\n'
    )
    m = parse_metrics(text)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1000.0, 512.0)
