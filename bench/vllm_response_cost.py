"""What vLLM's API server spends on one finished response with log-probs, on this machine's CPU: vLLM
0.33's own code for the token-in/token-out route (`/inference/v1/generate`: an object per generated
token, `model_dump`, JSON) against `/v1/completions` (flat lists, token ids as "token_id:N").

It tells whether building the responses of a batch of finished rollouts can stall vLLM's event loop
for seconds (bench/one_gpu.py's `round_trip_s` saw 3.5-11 s stalls as batches finished). It needs vLLM's
Python source and the pure-Python packages its protocol modules import, not a GPU or vLLM's kernels:

    pip download --no-deps vllm==0.33.0 && unzip -q vllm-0.33.0-*.whl 'vllm/*' -d /tmp/vllm-src
    PYTHONPATH=/tmp/vllm-src python bench/vllm_response_cost.py --tokens 1024 --responses 61
    PYTHONPATH=/tmp/vllm-src python bench/vllm_response_cost.py --busy-processes 16   # beside 16 busy cores

(each missing import names a package to `pip install --target DIR` and add to PYTHONPATH). Writes JSON
to bench/results/ with --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_gpu_report import write_json
from provenance import command_line


def routes(num_tokens: int):
    """The two routes' response builders for one finished sequence of `num_tokens` sampled tokens,
    requested with logprobs=0 (the sampled token's log-prob and rank only), as the trainer asks."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.scale_out.token_in_token_out import protocol as P
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
    from vllm.logprobs import Logprob

    ids = list(range(1000, 1000 + num_tokens))
    tops = [{t: Logprob(logprob=-1.25, rank=3, decoded_token=None)} for t in ids]
    usage = {"prompt_tokens": 200, "completion_tokens": num_tokens, "total_tokens": num_tokens + 200}

    def generate() -> str:
        logprobs = ServingTokens._create_tokens_logprobs(None, ids, tops)  # reads nothing of the instance
        choice = P.GenerateTokensChoice(index=0, token_ids=ids, logprobs=logprobs, finish_reason="length")
        response = P.GenerateTokensResponse(request_id="r", model="m", choices=[choice], usage=usage)
        return json.dumps(response.model_dump())  # what its route hands to JSONResponse

    class _CompletionServing:  # the attributes its log-prob builder reads of the serving instance
        return_tokens_as_token_ids = True
        _get_decoded_token = staticmethod(OpenAIServingCompletion._get_decoded_token)

    def completions() -> str:
        logprobs = OpenAIServingCompletion._create_completion_logprobs(
            _CompletionServing(), ids, tops, 0, None, return_as_token_id=True)
        return json.dumps({"choices": [{"index": 0, "token_ids": ids, "logprobs": logprobs.model_dump()}],
                           "usage": usage})

    return {"generate": generate, "completions": completions}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="generated tokens per response")
    p.add_argument("--responses", type=int, default=61,
                   help="responses finishing together (their total is reported)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--busy-processes", type=int, default=0,
                   help="Processes spinning in Python meanwhile (CPU contention as beside a trainer and an "
                   "engine)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        builders = routes(args.tokens)
    except ImportError as exc:
        raise SystemExit(f"vLLM's source or one of its pure-Python dependencies is missing ({exc}); see the "
                         "module docstring for how to put them on PYTHONPATH") from None
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy_processes)]
    try:
        results = time_builders(builders, args)
    finally:
        for spinner in spinners:
            spinner.kill()
    if args.out:
        write_json(Path(args.out), {"benchmark": "vllm_response_cost", "command": command_line(argv),
                                    "host": platform.node(),
                                    "cpu": platform.processor() or platform.machine(),
                                    "python": platform.python_version(), "args": vars(args),
                                    "results": results})


def time_builders(builders, args) -> dict:
    results = {}
    for name, build in builders.items():
        build()  # first-use set-up out of the timing
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            body = build()
            seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds)
        results[name] = {"median_s_per_response": median, "json_bytes": len(body),
                         f"s_for_{args.responses}_responses": median * args.responses}
        print(f"{name}: {median * 1e3:.1f} ms per {args.tokens}-token response "
              f"({len(body) / 1e3:.0f} kB JSON), {median * args.responses:.2f} s for {args.responses}")
    return results


if __name__ == "__main__":
    main()
