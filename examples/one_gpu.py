r"""Asynchronous GRPO on ONE GPU: a hub model learns grade-school math (GSM8K), with its generation
server on the same GPU.

The embedded server takes `--gpu-memory-utilization` of the GPU for its weights and KV cache; the
trainer keeps the rest. Generation (memory-bound) and training (compute-bound) run at the same time,
and after every optimizer step the trainer sends its weights to the server by CUDA IPC (the server
copies them from the trainer's GPU memory; nothing leaves the GPU). The trainer chooses IPC by itself
when the server reports the same GPU.

On CUDA the server runs inside this process (`ServerThread`: its HTTP loop and engine in threads, the
engine on a CUDA stream of its own), so that its decode steps run beside the trainer's kernels: two
processes on one GPU take turns on it instead. Measured (docs/performance.md, "One GPU"), the
asynchronous run trained 1.30x the on-policy run's tokens/s this way (0.6B, H100), and with the server
in its own process 1.13x (0.6B, H200) and 0.98x (1.7B, H100). `--server-process` runs it in its own
process (`asyncgrpo serve`), as on CPU, where the in-process server cannot take weights (it takes them
over CUDA IPC only).

    pip install 'asyncgrpo[math]'             # math-verify, for accuracy_reward
    python examples/one_gpu.py                 # Qwen/Qwen3-0.6B on openai/gsm8k, 200 steps
    python examples/one_gpu.py --model Qwen/Qwen3-1.7B --gpu-memory-utilization 0.3

With vLLM 0.33 instead of the embedded server, started on the same GPU with its CUDA IPC weight
transfer. vLLM's ipc backend receives the handles pickled, so it needs
VLLM_ALLOW_INSECURE_SERIALIZATION=1, which lets anyone who can reach its port run code in it: keep
it on 127.0.0.1 (vLLM's default here) on a machine you trust.

    VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-0.6B --port 8000 \
        --weight-transfer-config '{"backend": "ipc"}' --enable-scale-out \
        --logprobs-mode processed_logprobs --gpu-memory-utilization 0.35 --max-model-len 2048
    python examples/one_gpu.py --vllm-url http://127.0.0.1:8000

Sizing: the server's share holds its bf16 weights, one step's activations and the KV cache (every
token it keeps costs 2 x layers x KV heads x head_dim x 2 bytes: 112 KiB for Qwen3-0.6B and -1.7B);
the trainer's rest holds the float32 weights, gradients and Adam state (16 bytes per parameter: 9.6 GB
for 0.6B, 27 GB for 1.7B), the activations of one packed row of `--token-budget` tokens and a 1 GiB
buffer for the weight transfer. For example, 0.35 of an 80 GB GPU gives the server 28 GB (for
Qwen3-1.7B: 3.4 GB of weights and about 200k tokens of KV cache) and leaves the trainer 52 GB.

`--data-files` trains on a local JSON (a list) or JSON Lines file of GSM8K-shaped rows (`question`,
`answer` ending in `#### <number>`) instead of the hub dataset, read without `datasets`; `--device
cpu` runs everything on the CPU (what the test does with the bundled tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.cli_args import at_least, auto_bool, server_url
from asyncgrpo.config_rules import FLEX_BACKENDS
from asyncgrpo.launch import start_server as start_server_on
from asyncgrpo.rewards import accuracy_reward

INSTRUCTION = "Solve the problem step by step, then give the final answer as \\boxed{number}."


def to_prompt(row: dict[str, Any], instruction: str = INSTRUCTION) -> dict[str, Any]:
    """A GSM8K row -> a conversational prompt (the question, then `instruction`) and the gold answer
    (`accuracy_reward` reads `answer`): the number after GSM8K's final `####`, without thousands
    separators."""
    gold = row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
    content = f"{row['question']}\n\n{instruction}" if instruction else row["question"]
    return {"prompt": [{"role": "user", "content": content}], "answer": gold}


def load_rows(args: argparse.Namespace):
    """The training prompts: the hub dataset (through `datasets`), or the rows of a local file read as
    they are (a JSON list, or JSON Lines), which needs nothing beyond the standard library."""
    if args.data_files:
        with open(args.data_files) as f:
            text = f.read()
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [to_prompt(row, args.instruction) for row in rows]
    from datasets import load_dataset

    dataset = load_dataset(args.dataset, args.dataset_config, split=args.split)
    return dataset.map(to_prompt, fn_kwargs={"instruction": args.instruction},
                       remove_columns=dataset.column_names)


def start_server(args: argparse.Namespace, cuda: bool):
    """The embedded server on this machine: in this process on CUDA (unless --server-process), else in
    its own. Returns it started (it has `.url` and `.stop()`)."""
    serve_args = ["--max-model-len", str(args.max_model_len)]
    if cuda:
        serve_args += ["--dtype", "bfloat16", "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    # a server in its own process downloads a hub model itself (the launcher runs it offline unless told
    # otherwise)
    return start_server_on(args.model, device=args.device, extra_args=serve_args,
                           in_process=cuda and not args.server_process,
                           log_path=os.path.join(args.output_dir, "server.log"), startup_timeout_s=1800,
                           env={"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")})


def main(argv: list[str] | None = None) -> list[dict]:
    """Train; returns the Trainer's log history."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="Hub id, model folder or .gguf file.")
    p.add_argument("--dataset", default="openai/gsm8k")
    p.add_argument("--dataset-config", default="main")
    p.add_argument("--split", default="train")
    p.add_argument("--data-files", default=None, help="A local JSON/JSONL file of GSM8K rows instead.")
    p.add_argument("--vllm-url", type=server_url, default=None,
                   help="A running vLLM on this GPU instead of the embedded server.")
    p.add_argument("--device", default="cuda", help="cuda (one GPU for both) or cpu.")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="The embedded server's share.")
    p.add_argument("--server-process", action="store_true",
                   help="Run the embedded server in its own process (always so on CPU).")
    p.add_argument("--torch-compile", type=auto_bool, nargs="?", const=True, default=None,
                   help="Compiled decoder layers: auto (the trainer's default: on a GPU, checked at "
                        "start), on or off (1.7-2.2x the forward + backward in bench/packing.py on an "
                        "H100; tens of seconds of compilation at start).")
    p.add_argument("--activation-memory-budget", type=float, default=None,
                   help="With --torch-compile: recompute selectively instead of whole layers, keeping this "
                        "fraction of the activation memory (0.5: 9-16%% more tokens/s than checkpointing, "
                        "~3x its memory).")
    p.add_argument("--flex-attention-backend", choices=FLEX_BACKENDS, default="auto",
                   help="With compiled layers on a Hopper or Blackwell GPU: 'flash' runs the tree attention "
                        "on FlashAttention-4 (pip install flash-attn-4; 10-19%% more tokens/s in "
                        "bench/packing.py); 'auto' where it runs.")
    p.add_argument("--max-model-len", type=at_least(1), default=2048)
    p.add_argument("--max-steps", type=at_least(1), default=200)
    p.add_argument("--learning-rate", type=at_least(0, float), default=1e-6)
    p.add_argument("--num-generations", type=at_least(2), default=8)
    p.add_argument("--max-completion-length", type=at_least(1), default=1024)
    p.add_argument("--token-budget", type=at_least(1), default=8192,
                   help="Tokens per packed row (one forward).")
    p.add_argument("--grad-accum", type=at_least(1), default=4, help="Packed rows per optimizer step.")
    p.add_argument("--max-staleness", type=at_least(0), default=4)
    p.add_argument("--thinking", action="store_true", help="Let Qwen3 think first (longer completions).")
    p.add_argument("--instruction", default=INSTRUCTION, help="Appended to every question ('' for none).")
    p.add_argument("--output-dir", default="asyncgrpo-one-gpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = args.device != "cpu"

    rows = load_rows(args)
    server = start_server(args, cuda) if args.vllm_url is None else None
    try:
        config = AsyncGRPOConfig(
            output_dir=args.output_dir, vllm_server_base_url=args.vllm_url or server.url,
            max_steps=args.max_steps,
            learning_rate=args.learning_rate, num_generations=args.num_generations,
            max_completion_length=args.max_completion_length, token_budget=args.token_budget,
            gradient_accumulation_steps=args.grad_accum, max_staleness=args.max_staleness,
            chat_template_kwargs={"enable_thinking": args.thinking}, bf16=cuda, use_cpu=not cuda,
            gradient_checkpointing=cuda, torch_compile=args.torch_compile,
            activation_memory_budget=args.activation_memory_budget,
            flex_attention_backend=args.flex_attention_backend,
            save_strategy="no", report_to="none",
            logging_steps=1, seed=args.seed,
        )
        trainer = AsyncGRPOTrainer(model=args.model, reward_funcs=accuracy_reward, train_dataset=rows,
                                   args=config)
        trainer.train()
        trainer.save_model(args.output_dir)
    finally:
        if server is not None:
            server.stop()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    if rewards:
        tenth = max(1, len(rewards) // 10)
        print(f"mean reward: first {tenth} steps {sum(rewards[:tenth]) / tenth:.3f}, "
              f"last {tenth} steps {sum(rewards[-tenth:]) / tenth:.3f}; model saved to {args.output_dir}")
    return trainer.state.log_history

if __name__ == "__main__":
    main()
