"""Build the bundled tiny chat model ``asyncgrpo/tiny-chat`` from scratch, on CPU, deterministically.

Steps, top to bottom:
1. Generate the synthetic tasks (``asyncgrpo.tasks``): arithmetic with a short chain and
   ``\\boxed{}``, and the counter tool task (reference calls to ``increment``). The held-out
   arithmetic questions are excluded from training.
2. Train a byte-level BPE tokenizer (digits split into single characters) on the rendered
   conversations; add the Qwen3-style special tokens and the chat template below.
3. Train a small ``Qwen3ForCausalLM`` supervised on the assistant tokens only.
4. Evaluate on held-out sets of each task, sampling at temperature 1.0 with no top-k/top-p, with
   plain ``transformers`` ``generate`` (left padding); the counter task runs a multi-turn tool loop.
5. Save model, tokenizer, chat template, generation config and ``eval.json`` to the asset folder.

Run ``python scripts/build_tiny_model.py`` (about 7 minutes on 2 cores). ``--set key=value``
overrides a field of ``BuildConfig`` (for calibration runs, with ``--out`` elsewhere).
The same script on the same machine and library versions writes byte-identical files.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import random
import re
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from asyncgrpo.modeling.load import BUNDLED_MODELS
from asyncgrpo.tasks import arithmetic, counter

# Qwen2/Qwen3 pre-tokenizer pattern: every digit (\p{N}) is its own piece, so numbers are digit tokens.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Kept when decoding with skip_special_tokens=True, so tool calls and reasoning survive decoding.
TEXT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = r"""{#- asyncgrpo tiny-chat: Qwen3-style chat template that is prefix-preserving across turns.
    Unlike Qwen3's official template it never drops earlier <think> content (reasoning_content is
    rendered in every assistant turn), and every tool message is its own user turn, so rendering
    messages[:k] is a token prefix of rendering messages[:k+1]. `enable_thinking` is accepted and
    has no effect: the model answers directly. -#}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' -}}{{- tool | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + render_content(message.content) + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {%- set content = render_content(message.content) -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif message.reasoning is string -%}
            {%- set reasoning = message.reasoning -%}
        {%- else -%}
            {%- set reasoning = none -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- generation -%}
            {%- if reasoning is not none -%}
                {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
            {%- endif -%}
            {{- content -}}
            {%- if message.tool_calls -%}
                {%- for tool_call in message.tool_calls -%}
                    {%- if (loop.first and content) or not loop.first -%}
                        {{- '\n' -}}
                    {%- endif -%}
                    {%- if tool_call.function is defined -%}
                        {%- set tool_call = tool_call.function -%}
                    {%- endif -%}
                    {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}
                    {%- if tool_call.arguments is string -%}
                        {{- tool_call.arguments -}}
                    {%- else -%}
                        {{- tool_call.arguments | tojson -}}
                    {%- endif -%}
                    {{- '}\n</tool_call>' -}}
                {%- endfor -%}
            {%- endif -%}
            {{- '<|im_end|>' -}}
        {%- endgeneration -%}
        {{- '\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>user\n<tool_response>\n' + render_content(message.content) + '\n</tool_response><|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# transformers renamed `past_key_values` to `cache` (argument and output field) after 5.17.
CACHE_ARG = (
    "cache" if "cache" in inspect.signature(Qwen3ForCausalLM.forward).parameters else "past_key_values"
)
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclasses.dataclass
class BuildConfig:
    """Every knob of the build; the defaults produce the bundled model."""

    seed: int = 1234
    num_threads: int = 2
    # tokenizer
    vocab_size: int = 1024  # upper bound; the narrow corpus saturates below it
    tokenizer_corpus_size: int = 2000  # conversations per task
    # model
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 1024
    # training data and optimisation
    num_arithmetic_train: int = 45000
    num_counter_train: int = 14000
    batch_tokens: int = 1024  # forwarded tokens per optimizer step (small batches: more updates)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    # habits that RL can break: shares of the reference answers that lose the reward
    unboxed_frac: float = 0.35  # arithmetic: "37 + 8 = 45." without the closing \boxed{45}
    overshoot_frac: float = 0.35  # counter: every call adds max_step, the last one past the target
    # evaluation
    num_eval: int = 300  # per task
    eval_batch_size: int = 100
    max_turns: int = 8
    eval_seed: int = 99
    probe_every: int = 0  # > 0: also evaluate 100 items per task every this many steps (calibration)


# ---------------------------------------------------------------------------------------------- data


def counter_tools() -> list:
    """The tool list as the trainer passes it: the bound ``increment`` method of the environment."""
    return [counter.IncrementEnv().increment]


def arithmetic_conversation(row: dict, unboxed: bool = False) -> list[dict]:
    """The worked chain and its ``\\boxed{}`` answer; ``unboxed``: the chain alone."""
    answer = row["solution"].rsplit(" \\boxed", 1)[0] if unboxed else row["solution"]
    return row["prompt"] + [{"role": "assistant", "content": answer}]


def counter_conversation(row: dict, overshoot: bool = False) -> list[dict]:
    """The reference calls; ``overshoot``: every call adds ``max_step``, so the counter ends past
    the target whenever the last remainder is smaller (the reference solution of the target rounded
    up to a multiple of ``max_step``; the tool answers the real values)."""
    target, max_step = row["target"], row["max_step"]
    if overshoot:
        target = math.ceil(target / max_step) * max_step
    return row["prompt"] + counter.reference_messages(target, max_step)


def training_conversations(arith: list[dict], count: list[dict], cfg: BuildConfig) -> list[list[dict]]:
    """Every training conversation, arithmetic first.

    Two habits, drawn with a fixed seed, give RL one decision to learn on each task on top of the
    arithmetic itself: a share ``cfg.unboxed_frac`` of the arithmetic answers stop after the chain,
    without the ``\\boxed{}`` answer that rewards read, and a share ``cfg.overshoot_frac`` of the
    counter conversations always add the largest step, ending past the target.
    """
    rng = random.Random(cfg.seed + 30)
    out = [arithmetic_conversation(r, unboxed=rng.random() < cfg.unboxed_frac) for r in arith]
    return out + [counter_conversation(r, overshoot=rng.random() < cfg.overshoot_frac) for r in count]


def render(tokenizer_or_template, conversation: list[dict], tools=None, add_generation_prompt=False) -> str:
    """Render one conversation to text with the chat template (before a tokenizer exists, too)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = getattr(tokenizer_or_template, "chat_template", tokenizer_or_template)
    out, _ = render_jinja_template(
        [conversation], tools=tools, chat_template=template, add_generation_prompt=add_generation_prompt
    )
    return out[0]


# ----------------------------------------------------------------------------------------- tokenizer


def build_tokenizer(texts: list[str], cfg: BuildConfig) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``texts`` (special tokens cut out) and wrap it for transformers."""
    cut = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TEXT_TOKENS))
    corpus = [piece for text in texts for piece in cut.split(text) if piece]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=cfg.max_position_embeddings,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def assistant_mask(ids: list[int], tokenizer) -> list[int]:
    """1 for tokens the assistant generates: after ``<|im_start|>assistant\\n`` through ``<|im_end|>``."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tokenizer.encode("assistant\n", add_special_tokens=False)
    mask = [0] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i] == start and ids[i + 1 : i + 1 + len(header)] == header:
            j = i + 1 + len(header)
            while j < len(ids) and ids[j] != end:
                mask[j] = 1
                j += 1
            if j < len(ids):
                mask[j] = 1
            i = j
        i += 1
    return mask


# ------------------------------------------------------------------------------------------ training


def make_batches(costs: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Shuffle, sort by cost inside chunks of 512, cut into batches of <= batch_tokens padded tokens.

    ``costs[k]`` is the number of tokens example k is forwarded with (its length, less the prefix
    it shares with the other rows of its batch).
    """
    order = list(range(len(costs)))
    rng.shuffle(order)
    batches = []
    for c in range(0, len(order), 512):
        batch: list[int] = []
        for k in sorted(order[c : c + 512], key=lambda k: costs[k]):
            if batch and costs[k] * (len(batch) + 1) > batch_tokens:
                batches.append(batch)
                batch = []
            batch.append(k)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def collate(examples, batch: list[int], pad_id: int):
    """Right-padded input ids, attention mask and labels (-100 outside assistant tokens)."""
    width = max(len(examples[k][0]) for k in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for r, k in enumerate(batch):
        seq, mask = examples[k]
        ids[r, : len(seq)] = torch.tensor(seq)
        attn[r, : len(seq)] = 1
        labels[r, : len(seq)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(seq), -100)
    return ids, attn, labels


def shared_prefix_len(ids: torch.Tensor, labels: torch.Tensor) -> int:
    """Length of the token prefix that every row shares and that holds no trained target."""
    same = (ids == ids[:1]).all(dim=0).long()
    common = int(same.cumprod(0).sum())
    first_trained = int((labels != -100).any(dim=0).long().argmax())
    return min(common, first_trained - 1)


def batch_loss(model, ids: torch.Tensor, attn: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over trained targets.

    Counter conversations all open with the same system/tools block; when the rows share a prefix of
    at least 32 tokens, it is forwarded once and its KV cache repeated over the batch (about half the
    compute of those batches, same loss and gradients).
    """
    prefix = shared_prefix_len(ids, labels)
    if prefix >= 32:
        cache = getattr(model(input_ids=ids[:1, :prefix], use_cache=True), CACHE_ARG)
        cache.batch_repeat_interleave(ids.size(0))
        logits = model(input_ids=ids[:, prefix:], attention_mask=attn, **{CACHE_ARG: cache}).logits
        labels = labels[:, prefix:]
    else:
        logits = model(input_ids=ids, attention_mask=attn).logits
    logits, target = logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def train(model, examples, costs: list[int], cfg: BuildConfig, pad_id: int, probe=None) -> None:
    """One pass of AdamW over ``examples`` with linear warmup and cosine decay.

    ``probe(step)`` runs every ``cfg.probe_every`` steps (calibration runs only).
    """
    rng = random.Random(cfg.seed + 1)
    batches = make_batches(costs, cfg.batch_tokens, rng)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, len(batches) - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    t0, running = time.time(), None
    for step, batch in enumerate(batches):
        ids, attn, labels = collate(examples, batch, pad_id)
        loss = batch_loss(model, ids, attn, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if probe is not None and cfg.probe_every and (step + 1) % cfg.probe_every == 0:
            model.eval()
            probe(step + 1)
            model.train()
        if step % 100 == 0 or step == len(batches) - 1:
            print(
                f"  step {step + 1}/{len(batches)}  loss {running:.4f}  {time.time() - t0:.0f}s", flush=True
            )
    model.eval()


# ---------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def sample(model, tokenizer, texts: list[str], max_new_tokens: int) -> list[str]:
    """Sample one completion per prompt text at temperature 1.0 (no top-k/top-p), left padding."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = model.generate(
        **enc,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def rates(groups: list[str], ok: list[bool]) -> dict[str, float]:
    """Success rate per group name, sorted by name."""
    out: dict[str, list[bool]] = {}
    for g, o in zip(groups, ok):
        out.setdefault(g, []).append(o)
    return {g: round(sum(v) / len(v), 4) for g, v in sorted(out.items())}


def eval_arithmetic(model, tokenizer, rows: list[dict], cfg: BuildConfig) -> list[bool]:
    ok = []
    for b in range(0, len(rows), cfg.eval_batch_size):
        chunk = rows[b : b + cfg.eval_batch_size]
        texts = [render(tokenizer, r["prompt"], add_generation_prompt=True) for r in chunk]
        for row, completion in zip(chunk, sample(model, tokenizer, texts, 48)):
            ok.append(arithmetic.is_correct(completion, row["answer"]))
            if not ok[-1] and sum(not o for o in ok) <= 3:
                print(f"    wrong: {row['prompt'][0]['content']} -> {completion!r}", flush=True)
    return ok


def parse_tool_calls(text: str) -> tuple[str, list[dict]] | None:
    """Split a completion into (content, tool calls); None when a ``<tool_call>`` is not valid JSON."""
    calls = []
    for raw in TOOL_CALL_RE.findall(text):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
            return None
        calls.append(
            {"type": "function", "function": {"name": call.get("name"), "arguments": call["arguments"]}}
        )
    if "<tool_call>" in text and not calls:
        return None
    return text.split("<tool_call>")[0].strip(), calls


def run_tool(env: counter.IncrementEnv, call: dict) -> str:
    fn = call["function"]
    if fn["name"] != "increment":
        return f"Error: unknown tool {fn['name']!r}"
    try:
        return str(env.increment(**fn["arguments"]))
    except (TypeError, ValueError) as exc:
        return f"Error: {exc}"


def eval_counter(model, tokenizer, rows: list[dict], cfg: BuildConfig) -> list[bool]:
    """Multi-turn tool loop; success = counter at target and the model stopped calling tools."""
    tools = counter_tools()
    envs, chats = [], []
    for row in rows:
        env = counter.IncrementEnv()
        env.reset(**{k: v for k, v in row.items() if k != "prompt"})
        envs.append(env)
        chats.append(list(row["prompt"]))
    success = [False] * len(rows)
    active = list(range(len(rows)))
    for _ in range(cfg.max_turns):
        still = []
        for b in range(0, len(active), cfg.eval_batch_size):
            chunk = active[b : b + cfg.eval_batch_size]
            texts = [render(tokenizer, chats[i], tools=tools, add_generation_prompt=True) for i in chunk]
            for i, completion in zip(chunk, sample(model, tokenizer, texts, 40)):
                parsed = parse_tool_calls(completion)
                if parsed is None:
                    continue  # malformed tool call: failure
                content, calls = parsed
                if not calls:
                    success[i] = envs[i].get_reward() == 1.0
                    continue
                chats[i].append({"role": "assistant", "content": content, "tool_calls": calls})
                for call in calls:
                    chats[i].append({"role": "tool", "name": "increment", "content": run_tool(envs[i], call)})
                still.append(i)
        active = still
        if not active:
            break
    shown = 0
    for i, ok in enumerate(success):
        if not ok and shown < 3:
            shown += 1
            turns = [m.get("tool_calls", m["content"]) for m in chats[i][1:]]
            print(f"    failed: {rows[i]['prompt'][0]['content']} -> {turns}", flush=True)
    return success


# -------------------------------------------------------------------------------------------- driver


def build(cfg: BuildConfig, out_dir: Path) -> dict:
    t_start = time.time()
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True)

    print("[1/5] generating tasks", flush=True)
    eval_arith = arithmetic.make_dataset(cfg.num_eval, seed=cfg.seed + 10)
    eval_count = counter.make_dataset(cfg.num_eval, seed=cfg.seed + 11)
    held_out = {r["prompt"][0]["content"] for r in eval_arith}
    train_arith = arithmetic.make_dataset(cfg.num_arithmetic_train, seed=cfg.seed + 20, exclude=held_out)
    train_count = counter.make_dataset(cfg.num_counter_train, seed=cfg.seed + 21)
    tools = counter_tools()

    print("[2/5] training tokenizer", flush=True)
    n = cfg.tokenizer_corpus_size
    corpus = [render(CHAT_TEMPLATE, arithmetic_conversation(r)) for r in train_arith[:n]]
    corpus += [render(CHAT_TEMPLATE, counter_conversation(r), tools=tools) for r in train_count[:n]]
    tokenizer = build_tokenizer(corpus, cfg)
    print(f"  vocab {len(tokenizer)}", flush=True)

    conversations = training_conversations(train_arith, train_count, cfg)
    texts = [render(tokenizer, c) for c in conversations[: len(train_arith)]]
    texts += [render(tokenizer, c, tools=tools) for c in conversations[len(train_arith) :]]
    examples = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        examples.append((ids, assistant_mask(ids, tokenizer)))
    num_tokens = sum(len(e[0]) for e in examples)
    # counter conversations share their opening (system block with tools, start of the request)
    counter_ids = [torch.tensor(e[0][:256]) for e in examples[len(train_arith) :]]
    width = min(len(t) for t in counter_ids)
    stacked = torch.stack([t[:width] for t in counter_ids])
    trained = torch.tensor([e[1][:width] for e in examples[len(train_arith) :]], dtype=torch.bool)
    shared = shared_prefix_len(stacked, torch.where(trained, 0, -100))
    costs = [len(ids) for ids, _ in examples[: len(train_arith)]]
    costs += [len(ids) - shared for ids, _ in examples[len(train_arith) :]]
    print(
        f"  {len(examples)} examples, {num_tokens} tokens, {sum(costs)} after sharing the counter prefix"
        f" of {shared} ({time.time() - t_start:.0f}s)",
        flush=True,
    )

    print("[3/5] training model", flush=True)
    im_end, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=pad,
    )
    model = Qwen3ForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"  {num_params} parameters", flush=True)

    def probe(step: int) -> None:
        arith = rates(
            [r["kind"] for r in eval_arith[:100]], eval_arithmetic(model, tokenizer, eval_arith[:100], cfg)
        )
        count = eval_counter(model, tokenizer, eval_count[:100], cfg)
        print(f"  probe step {step}: arithmetic {arith} counter {sum(count) / len(count):.2f}", flush=True)

    train(model, examples, costs, cfg, pad, probe)
    t_train = time.time() - t_start

    print("[4/5] evaluating (temperature 1.0)", flush=True)
    torch.manual_seed(cfg.eval_seed)
    arith_ok = eval_arithmetic(model, tokenizer, eval_arith, cfg)
    arith_rate = sum(arith_ok) / len(arith_ok)
    arith_by_kind = rates([r["kind"] for r in eval_arith], arith_ok)
    print(f"  arithmetic {arith_rate:.3f} {arith_by_kind}", flush=True)
    count_ok = eval_counter(model, tokenizer, eval_count, cfg)
    count_rate = sum(count_ok) / len(count_ok)
    calls = [f"{math.ceil(r['target'] / r['max_step'])}_calls" for r in eval_count]
    count_by_calls = rates(calls, count_ok)
    print(f"  counter {count_rate:.3f} {count_by_calls}", flush=True)

    print(f"[5/5] saving to {out_dir}", flush=True)
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=256,
        eos_token_id=im_end,
        pad_token_id=pad,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    report = {
        "arithmetic_success_rate": arith_rate,
        "counter_success_rate": count_rate,
        "arithmetic_by_kind": arith_by_kind,
        "counter_by_calls_needed": count_by_calls,
        "num_eval_per_task": cfg.num_eval,
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "num_parameters": num_params,
        "vocab_size": len(tokenizer),
        "num_train_tokens": num_tokens,
        "config": dataclasses.asdict(cfg),
    }
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "README.md").write_text(model_card(report, config))
    wall = time.time() - t_start
    print(f"done in {wall:.0f}s (training {t_train:.0f}s)", flush=True)
    print(f"held-out success at temperature 1.0: arithmetic {arith_rate:.1%}, counter {count_rate:.1%}")
    return report


def model_card(report: dict, config: Qwen3Config) -> str:
    return f"""# asyncgrpo/tiny-chat

A {report["num_parameters"]:,}-parameter `Qwen3ForCausalLM` ({config.num_hidden_layers} layers, \
hidden {config.hidden_size}, {config.num_attention_heads} query / {config.num_key_value_heads} key-value \
heads, tied embeddings) with its own byte-level BPE tokenizer ({report["vocab_size"]} tokens, digits \
split) and a prefix-preserving Qwen3-style chat template with tool calling. Trained from scratch, \
supervised, on the two synthetic tasks of `asyncgrpo.tasks`, so that RL has room to improve it. \
It keeps two habits of its training data that RL removes: {report["config"]["unboxed_frac"]:.0%} of the \
arithmetic answers stop after the working, without the `\\boxed{{}}` answer that rewards read \
(`asyncgrpo demo`), and {report["config"]["overshoot_frac"]:.0%} of the counter conversations always \
add the largest step, ending past the target (`examples/increment_env.py`).

Held-out success, sampling at temperature 1.0 without top-k/top-p ({report["num_eval_per_task"]} items each):

| task | success |
|---|---|
| arithmetic (`\\boxed{{}}` answer) | {report["arithmetic_success_rate"]:.1%} |
| counter (`increment` tool, 8 turns at most) | {report["counter_success_rate"]:.1%} |

Rebuild with `python scripts/build_tiny_model.py` (CPU, deterministic); `eval.json` has the details.
"""


def parse_overrides(items: list[str]) -> dict:
    fields = {f.name: f.type for f in dataclasses.fields(BuildConfig)}
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {item}: unknown field {key!r}; fields are {sorted(fields)}")
        out[key] = {"int": int, "float": float}[fields[key]](value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(BUNDLED_MODELS["asyncgrpo/tiny-chat"]))
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    args = parser.parse_args()
    build(BuildConfig(**parse_overrides(args.set)), args.out)


if __name__ == "__main__":
    main()
