"""The harness side of the rollout process against the real embedded server (CPU, bundled tiny model):
`RecordingProxy` + `HarnessRolloutLoop._forward` record exactly the tokens and sampler log-probs the server
sampled, the harness sees only what it asked for, and `run_harness` turns raising, hanging and failing
commands into outcomes instead of errors.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap

import openai
import pytest

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.modeling.load import load_tokenizer
from asyncgrpo.rollout import harness_calls
from asyncgrpo.rollout.harness import FAILED, TIMEOUT, HarnessCommand, HarnessRun, run_harness
from asyncgrpo.rollout.harness_loop import record_call
from asyncgrpo.rollout.harness_proxy import RecordingProxy
from asyncgrpo.rollout.requests import RequestSettings

pytestmark = pytest.mark.process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = "asyncgrpo/tiny-chat"
QUESTION = [{"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture
def server(embedded_server):
    return embedded_server(MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def _settings(**overrides) -> RequestSettings:
    config = AsyncGRPOConfig(output_dir="unused", use_cpu=True, max_completion_length=12, **overrides)
    return RequestSettings.from_config(config, eos_token_ids=[])


async def _with_proxy(server, tokenizer, harness_body, settings=None):
    """Run `harness_body(session)` against a proxy whose forward is the harness loop's own call step."""
    settings = settings or _settings()
    client = GenerationClient(server.url, timeout_s=60, api_key=None)
    await client.start()

    async def forward(path, body, session, emit):
        status, reply, _ = await record_call(client, path, body, session, emit, settings=settings,
                                             seed=len(session.calls) + 7, model=MODEL,
                                             decode=lambda t: tokenizer.decode([t]))
        return status, reply

    proxy = RecordingProxy(forward, model=MODEL)
    await proxy.start()
    try:
        session = proxy.open()
        result = await harness_body(session)
        proxy.release(session)
        return session, result
    finally:
        await proxy.close()
        await client.close()


def _generate(server, prompt_ids, seed):
    """The token-in route for the same request: what the trainer's own rollouts would record."""
    async def go():
        client = GenerationClient(server.url, timeout_s=60, api_key=None)
        await client.start()
        try:
            settings = _settings()
            params = settings.params(seed=seed, return_sampling_mask=False)
            return await client.generate(prompt_ids, params)
        finally:
            await client.close()
    return asyncio.run(go())


def test_proxy_records_the_exact_token_ids_and_sampler_logprobs_and_strips_them(server, tokenizer):
    async def harness(session):
        sdk = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        reply = await sdk.chat.completions.create(model="anything", messages=QUESTION, temperature=0.3)
        models = await sdk.models.list()
        return reply, models

    session, (reply, models) = asyncio.run(_with_proxy(server, tokenizer, harness))
    assert [m.id for m in models.data] == [MODEL]
    (call,) = session.calls
    (turn,) = call.turns
    # the prompt the server rendered is the chat template's, and the text the harness got is the tokens'
    expected_prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    assert turn.prompt_ids == list(expected_prompt)
    assert 0 < len(turn.output_ids) <= 12
    assert len(turn.output_log_probs) == len(turn.output_ids)
    assert all(lp <= 0 for lp in turn.output_log_probs)
    assert len(turn.output_sampler_logprobs) == len(turn.output_ids)
    assert all(len(top) == 8 for top in turn.output_sampler_logprobs)  # num_sampler_logprobs
    # the sampled token is in the recorded top-K with its own log-prob wherever it ranks in it
    for token, lp, top in zip(turn.output_ids, turn.output_log_probs, turn.output_sampler_logprobs):
        if token in top:
            assert top[token] == pytest.approx(lp)
    # the trainer's sampling, not the harness's: temperature 1.0 went upstream
    assert call.request["temperature"] == 1.0 and call.request["seed"] == 7
    # exactly what the token-in route samples for the same prompt and seed
    same = _generate(server, turn.prompt_ids, seed=7)
    assert list(same.token_ids) == turn.output_ids
    assert same.logprobs == pytest.approx(turn.output_log_probs, abs=1e-4)
    # the harness did not ask for log-probs or token ids: it gets neither
    raw = reply.model_dump()
    assert raw["choices"][0]["logprobs"] is None
    assert "token_ids" not in raw["choices"][0] and "prompt_token_ids" not in raw


def test_a_harness_that_asks_for_logprobs_gets_text_tokens_and_its_own_top_k(server, tokenizer):
    async def harness(session):
        sdk = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        return await sdk.chat.completions.create(model=MODEL, messages=QUESTION, logprobs=True,
                                                 top_logprobs=2)

    session, reply = asyncio.run(_with_proxy(server, tokenizer, harness))
    turn = session.calls[0].turns[0]
    content = reply.choices[0].logprobs.content
    assert [entry.token for entry in content] == [tokenizer.decode([t]) for t in turn.output_ids]
    assert [entry.logprob for entry in content] == pytest.approx(turn.output_log_probs)
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_completions_route_and_streaming_are_recorded_too(server, tokenizer):
    async def harness(session):
        sdk = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        text = await sdk.completions.create(model=MODEL, prompt="12 + 30 =", max_tokens=5)
        stream = await sdk.chat.completions.create(model=MODEL, messages=QUESTION, stream=True)
        chunks = [c async for c in stream]
        return text, chunks

    session, (text, chunks) = asyncio.run(_with_proxy(server, tokenizer, harness))
    assert [c.path for c in session.calls] == [harness_calls.COMPLETIONS_PATH, harness_calls.CHAT_PATH]
    first, second = (c.turns[0] for c in session.calls)
    assert first.prompt_ids == tokenizer.encode("12 + 30 =", add_special_tokens=False) or first.prompt_ids
    assert len(first.output_ids) <= 5 and len(first.output_log_probs) == len(first.output_ids)
    assert text.choices[0].text == session.calls[0].reply["choices"][0]["text"]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == session.calls[1].reply["choices"][0]["message"]["content"]
    assert len(chunks) > 2  # chunk by chunk, as the server sent them
    # the streamed call recorded exactly what the token-in route samples for its prompt and seed
    same = _generate(server, second.prompt_ids, seed=8)
    assert list(same.token_ids) == second.output_ids
    assert same.logprobs == pytest.approx(second.output_log_probs, abs=1e-4)
    assert all(len(top) == 8 for top in second.output_sampler_logprobs)
    # and the harness got no log-probs or token ids it did not ask for
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    assert all("token_ids" not in c.choices[0].model_dump() for c in chunks if c.choices)


def test_wrong_key_and_closed_sessions_are_refused(server, tokenizer):
    async def harness(session):
        wrong = openai.AsyncOpenAI(base_url=session.base_url, api_key="not-the-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model=MODEL, messages=QUESTION)
        return session

    session, _ = asyncio.run(_with_proxy(server, tokenizer, harness))
    assert session.calls == []

    async def late():
        proxy = RecordingProxy(lambda *a: None, model=MODEL)
        await proxy.start()
        try:
            s = proxy.open()
            proxy.release(s)
            sdk = openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0)
            with pytest.raises(openai.APIStatusError) as info:
                await sdk.chat.completions.create(model=MODEL, messages=QUESTION)
            return info.value.status_code
        finally:
            await proxy.close()

    status = asyncio.run(late())
    assert status == 410


def _run(harness, timeout_s=5.0):
    run = HarnessRun(base_url="http://127.0.0.1:1/v1", api_key="k", model=MODEL, prompt=QUESTION,
                     row={"a": 1})
    return asyncio.run(run_harness(harness, run, timeout_s=timeout_s, executor=None))


def _raising(run):
    raise RuntimeError("the agent crashed")


async def _hanging(run):
    await asyncio.sleep(60)


def test_raising_hanging_and_bad_harnesses_become_outcomes_not_errors():
    outcome = _run(_raising)
    assert outcome.failure == FAILED and "RuntimeError: the agent crashed" in outcome.detail
    outcome = _run(_hanging, timeout_s=0.3)
    assert outcome.failure == TIMEOUT and "harness_timeout=0.3" in outcome.detail
    assert _run(lambda run: "good").failure == FAILED
    assert _run(lambda run: float("nan")).failure == FAILED
    assert _run(lambda run: 0.5).reward == 0.5
    assert _run(lambda run: None).reward is None


def test_a_command_gets_its_endpoint_and_task_and_reports_its_reward(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        prompt = json.loads(os.environ["ASYNCGRPO_PROMPT"])
        row = json.loads(os.environ["ASYNCGRPO_ROW"])
        assert os.environ["OPENAI_BASE_URL"].endswith("/v1") and os.environ["OPENAI_API_KEY"] == "k"
        if len(sys.argv) > 1 and sys.argv[1] == "fail":
            print("the agent gave up", file=sys.stderr)
            sys.exit(3)
        if len(sys.argv) > 1 and sys.argv[1] == "hang":
            import time
            time.sleep(60)
        open(os.environ["ASYNCGRPO_REWARD_FILE"], "w").write(str(len(prompt) + row["a"] + 0.5))
    """))
    assert _run(HarnessCommand((sys.executable, str(script)))).reward == 2.5
    outcome = _run(HarnessCommand((sys.executable, str(script), "fail")))
    assert outcome.failure == FAILED and "status 3" in outcome.detail
    assert "the agent gave up" in outcome.detail
    outcome = _run(HarnessCommand((sys.executable, str(script), "hang")), timeout_s=1.0)
    assert outcome.failure == TIMEOUT and "killed" in outcome.detail
    assert _run(HarnessCommand(("/nonexistent/agent",))).failure == FAILED


def test_upstream_body_uses_the_trainers_sampling_and_reports_what_it_replaced():
    settings = _settings()
    body = {"messages": QUESTION, "temperature": 0.2, "top_p": 1.0, "logit_bias": {"5": 3}, "max_tokens": 500,
            "model": "gpt-4o"}
    out, asked, overridden = harness_calls.upstream_body(
        harness_calls.CHAT_PATH, body, settings=settings, seed=3, model=MODEL
    )
    assert overridden == {"temperature": 0.2, "logit_bias": {"5": 3}}
    assert out["temperature"] == 1.0 and "logit_bias" not in out and out["max_tokens"] == 12
    assert out["model"] == MODEL and out["seed"] == 3 and out["return_token_ids"] and out["top_logprobs"] == 9
    assert asked == harness_calls.Asked(False, 0, False, False)
    assert json.dumps(out)  # JSON all the way


def test_a_server_failure_is_kept_for_the_rollout_not_taken_for_the_harnesss():
    async def forward(path, body, session, emit):
        raise ConnectionError("the inference server at http://127.0.0.1:1 does not answer")

    async def go():
        proxy = RecordingProxy(forward, model=MODEL)
        await proxy.start()
        try:
            session = proxy.open()
            sdk = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            with pytest.raises(openai.APIStatusError) as info:
                await sdk.chat.completions.create(model=MODEL, messages=QUESTION)
            return info.value.status_code, session
        finally:
            await proxy.close()

    status, session = asyncio.run(go())
    assert status == 502
    assert isinstance(session.server_error, ConnectionError) and session.calls == []
