"""Training an agent written against the `openai` SDK, unchanged: `HarnessAsyncGRPOTrainer`.

The agent below is an ordinary OpenAI tool-calling loop: it sends the task with an `increment` tool, runs
every call the model makes, sends the results back and stops when the model answers without a call. It
knows nothing about training; the trainer gives each run (one rollout) a base URL and an API key of its
own, and a recording proxy behind them keeps the token ids and sampler log-probs of every model call.
The agent returns its reward (1.0 when the counter ends at the target without a step above the limit);
the recorded turns train the model exactly as the built-in tool loop's would.

The task is the counter of the bundled tiny model (asyncgrpo.tasks.counter), which was trained on this
tool's exact schema. The same agent could be a command instead (`harness=["python", "agent.py"]`): it
then reads OPENAI_BASE_URL / OPENAI_API_KEY and writes its reward to $ASYNCGRPO_REWARD_FILE.

    python examples/harness_openai.py --max-steps 30
"""

from __future__ import annotations

import argparse
import json
import os

import openai
from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, HarnessRun
from asyncgrpo.cli import at_least
from asyncgrpo.launch import EmbeddedServer
from asyncgrpo.tasks import counter

MODEL = "asyncgrpo/tiny-chat"
MAX_TURNS = 8
INCREMENT = {"type": "function", "function": {
    "name": "increment", "description": "Increment the internal counter.",
    "parameters": {"type": "object", "required": ["step"],
                   "properties": {"step": {"type": "integer",
                                           "description": "Value to add to the counter."}}},
    "return": {"type": "integer", "description": "The updated counter value."}}}


async def counter_agent(run: HarnessRun) -> float:
    """One episode of the agent; its reward. `run.row` is the task's dataset row (target, max_step)."""
    client = openai.AsyncOpenAI(base_url=run.base_url, api_key=run.api_key, max_retries=0)
    messages = list(run.prompt)
    value, within_limit = 0, True
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=run.model, messages=messages, tools=[INCREMENT])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                step = int(json.loads(call.function.arguments)["step"])
                if call.function.name != "increment" or step < 1:
                    raise ValueError(f"cannot call {call.function.name}({call.function.arguments})")
                value += step
                within_limit &= step <= run.row["max_step"]
                result = str(value)
            except (ValueError, KeyError, TypeError) as exc:
                result = f"Error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return float(within_limit and value == run.row["target"])


def main(argv: list[str] | None = None) -> list[dict]:
    """Train; returns the Trainer's log history."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=at_least(1), default=30)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--output-dir", default="asyncgrpo-harness")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.model == MODEL:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with EmbeddedServer(args.model) as server:
        trainer = HarnessAsyncGRPOTrainer(
            model=args.model,
            harness=counter_agent,
            train_dataset=Dataset.from_list(counter.make_dataset(2000, seed=args.seed)),
            args=AsyncGRPOConfig(
                output_dir=args.output_dir, vllm_server_base_url=server.url, max_steps=args.max_steps,
                learning_rate=2e-4, num_generations=8, max_completion_length=48, harness_timeout=120.0,
                seed=args.seed, bf16=False, use_cpu=True, gradient_checkpointing=False, save_strategy="no",
                report_to="none", logging_steps=1,
            ),
        )
        trainer.train()
    last = trainer.state.log_history[-2] if len(trainer.state.log_history) > 1 else {}
    print({k: v for k, v in last.items() if k.startswith(("reward", "harness/", "rollout/turns"))})
    return trainer.state.log_history


if __name__ == "__main__":
    main()
