"""NCCL weight push from our sender into a real vLLM server on another GPU.

Start vLLM (>= 0.30) with the weight-transfer engine on one GPU, then run this test on another:

    VLLM_SERVER_DEV_MODE=1 CUDA_VISIBLE_DEVICES=0 vllm serve MODEL_DIR --port 8001 \\
        --weight-transfer-config '{"backend":"nccl"}' --enable-scale-out --logprobs-mode processed_logprobs
    ASYNCGRPO_TEST_VLLM_URL=http://127.0.0.1:8001 ASYNCGRPO_TEST_VLLM_MODEL=MODEL_DIR \\
        CUDA_VISIBLE_DEVICES=1 pytest -m gpu tests/gpu/test_vllm_push.py

The test pushes a perturbed copy of the served model (every tensor, packed layout, several buckets)
and checks that vLLM now generates from the pushed weights: the log-probs vLLM reports for the
tokens it samples match the pushed model run here (bf16 tolerance) and not the original one.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300, method="thread")]

VLLM_URL = os.environ.get("ASYNCGRPO_TEST_VLLM_URL")
VLLM_MODEL = os.environ.get("ASYNCGRPO_TEST_VLLM_MODEL")
needs_vllm = pytest.mark.skipif(
    not (VLLM_URL and VLLM_MODEL and torch.cuda.is_available()),
    reason="needs a GPU and a running vLLM (ASYNCGRPO_TEST_VLLM_URL, ASYNCGRPO_TEST_VLLM_MODEL)",
)


def _perturbed(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter by a sizeable random step (in place), so the two models disagree."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            p.add_((noise * p.float().std().clamp_min(1e-3) * 0.5).to(p.dtype))


def _sampled_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens], device="cuda")
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]


@needs_vllm
def test_push_into_vllm_changes_generation_to_the_pushed_weights():
    """The trainer's path: its `CollectiveTransport` pauses vLLM (keep, `ServerLink`), pushes over NCCL,
    resumes."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from asyncgrpo.generation.protocol import SamplingParams
    from asyncgrpo.train.server_link import ServerLink
    from asyncgrpo.train.weights.collective import CollectiveTransport

    original = AutoModelForCausalLM.from_pretrained(VLLM_MODEL, dtype=torch.bfloat16).cuda().eval()
    pushed = AutoModelForCausalLM.from_pretrained(VLLM_MODEL, dtype=torch.bfloat16).cuda().eval()
    _perturbed(pushed, seed=1)
    vocab = original.config.vocab_size
    prompts = [
        torch.randint(2, vocab, (32,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)
    ]
    params = SamplingParams(temperature=1.0, top_k=0, max_tokens=32, ignore_eos=True, logprobs=0)

    link = ServerLink(VLLM_URL, timeout_s=120)

    def generate() -> list:
        async def all_prompts():
            return await asyncio.gather(
                *(link.client.generate(p, dataclasses.replace(params, seed=i)) for i, p in enumerate(prompts))
            )

        return link._run(all_prompts())

    transport = CollectiveTransport(link, torch.device("cuda"), torch.bfloat16)
    try:
        link.connect()
        before = generate()
        transport.init()
        stats = transport.send(iter(pushed.state_dict().items()), label="pushed-1")
        after = generate()
    finally:
        transport.close()
        link.close()

    def gap(outputs, model) -> float:
        diffs = [
            (torch.tensor(out.logprobs, device="cuda") - _sampled_logprobs(model, p, out.token_ids))
            .abs()
            .mean()
            for p, out in zip(prompts, outputs)
        ]
        return float(torch.stack(diffs).mean())

    before_vs_original, after_vs_pushed, after_vs_original = (
        gap(before, original),
        gap(after, pushed),
        gap(after, original),
    )
    gbps = stats["bytes"] / stats["transfer_s"] / 1e9
    print(
        f"sync: {stats} ({gbps:.1f} GB/s); mean |logprob diff|: before vs original {before_vs_original:.4f}, "
        f"after vs pushed {after_vs_pushed:.4f}, after vs original {after_vs_original:.4f}"
    )
    assert before_vs_original < 0.05
    assert after_vs_pushed < 0.05
    assert after_vs_original > 10 * after_vs_pushed
