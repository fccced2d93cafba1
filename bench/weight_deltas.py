"""How much of a weight push is new: the fraction of the served (bf16) weights one optimizer step changes.

A server keeps its weights in bfloat16 while the trainer steps float32 master weights. An AdamW step moves
each master weight by about the learning rate (Adam normalizes the gradient), far less than a bf16 word's
spacing (2^-8 of its value) for most weights, so most bf16 words come out of the cast unchanged. This
measures, per step and learning rate, the words that do change, and what a push of only those would
cost against the full push:

    full     every word: 2 bytes each
    delta    per tensor the cheaper of (a) the changed words' int32 indices and bf16 values (6 bytes each)
             and (b) a bitmask of the changed words plus their values (1/8 byte per word + 2 each)
    sent     what `weight_push="delta"` sends (`asyncgrpo.sync.delta.encode_delta`): per tensor (a), or
             the whole tensor when (a) would not be smaller

The steps are real AdamW steps (the trainer's settings: betas 0.9/0.999, eps 1e-8, no weight decay, the
gradient clipped to norm 1.0) of a GRPO-shaped loss: advantage-weighted log-probs of sampled-looking
completions (the model's own chat-formatted arithmetic prompts followed by its greedy continuation), with
advantages of +-1 drawn per sequence, the structure of the policy-gradient term of the trainer's loss.
Each learning rate starts from the same weights and the same optimizer state (none).

    python bench/weight_deltas.py                                                   # the bundled tiny model
    python bench/weight_deltas.py --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf --sequences 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from provenance import command_line, package_versions

from asyncgrpo.modeling.load import resolve_model_path
from asyncgrpo.sync.delta import encode_delta
from asyncgrpo.tasks import arithmetic

ROOT = Path(__file__).resolve().parents[1]


def push_bytes(changed: int, numel: int) -> int:
    """Bytes of a delta push of one tensor: the cheaper of indices + values and bitmask + values."""
    return min(changed * 6, math.ceil(numel / 8) + changed * 2)


def served(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16).clone() for name, p in model.named_parameters()}


def compare(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict:
    words = changed = delta = sent = 0
    for name, old in before.items():
        new = after[name]
        n = old.numel()
        c = int((old.view(torch.int16) != new.view(torch.int16)).sum())
        words += n
        changed += c
        delta += push_bytes(c, n)
        sent += encode_delta(old, new).nbytes
    return {
        "changed_fraction": changed / words,
        "full_bytes": words * 2,
        "delta_bytes": delta,
        "delta_over_full": delta / (words * 2),
        "sent_bytes": sent,
        "sent_over_full": sent / (words * 2),
    }


def batch(tokenizer, model, sequences: int, completion_tokens: int, seed: int):
    """Chat-formatted arithmetic prompts with the model's own greedy continuations, a mask of the
    completion tokens and an advantage of +-1 per sequence."""
    rows = arithmetic.make_dataset(sequences, seed=seed, kinds=arithmetic.SMALL_MODEL_KINDS)
    texts = [
        tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        for row in rows
    ]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=completion_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    mask = torch.zeros_like(out, dtype=torch.float32)
    mask[:, enc["input_ids"].shape[1] :] = 1.0
    attention = torch.cat([enc["attention_mask"], torch.ones_like(out[:, enc["input_ids"].shape[1] :])], 1)
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randint(0, 2, (sequences,), generator=g).float() * 2 - 1
    return out, attention, mask, advantages


def grpo_loss(model, ids, attention, mask, advantages) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:]
    per_sequence = (logp * m).sum(1) / m.sum(1).clamp(min=1)
    return -(advantages * per_sequence).mean()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="asyncgrpo/tiny-chat")
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--completion-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    start = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, attention, mask, advantages = batch(
        tokenizer, start, args.sequences, args.completion_tokens, args.seed
    )
    initial = {k: v.clone() for k, v in start.state_dict().items()}
    params = sum(p.numel() for p in start.parameters())
    print(f"{args.model}: {params / 1e6:.1f}M parameters, {ids.shape[0]} x {ids.shape[1]} tokens", flush=True)

    results = []
    for lr in args.learning_rates:
        start.load_state_dict(initial)
        model = start.train()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
        previous = served(model)
        steps = []
        for step in range(1, args.steps + 1):
            t = time.perf_counter()
            loss = grpo_loss(model, ids, attention, mask, advantages)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            now = served(model)
            entry = {"step": step, "loss": loss.item(), **compare(previous, now)}
            previous = now
            steps.append(entry)
            print(
                f"lr {lr:g} step {step}: {entry['changed_fraction']:.2%} of bf16 words changed, "
                f"delta push {entry['delta_over_full']:.1%} of full, sent by weight_push='delta' "
                f"{entry['sent_over_full']:.1%} ({time.perf_counter() - t:.1f}s)",
                flush=True,
            )
        later = steps[1:] or steps
        results.append(
            {
                "learning_rate": lr,
                "steps": steps,
                "changed_fraction_after_step_1": sum(s["changed_fraction"] for s in later) / len(later),
                "delta_over_full_after_step_1": sum(s["delta_over_full"] for s in later) / len(later),
                "sent_over_full_after_step_1": sum(s["sent_over_full"] for s in later) / len(later),
            }
        )

    name = Path(args.model).name.split(".")[0].lower().replace("/", "-")
    out = Path(args.out or ROOT / "bench" / "results" / f"weight_deltas_{name}.json")
    report = {
        "command": command_line(),
        "packages": package_versions(),
        "model": args.model,
        "parameters": params,
        "tokens": list(ids.shape),
        "results": results,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
