"""The embedded generation server (`asyncgrpo serve MODEL`): the subset of vLLM 0.33's HTTP protocol
that asyncgrpo uses, over a continuous-batching engine with a paged KV cache.

    serve.py              the `asyncgrpo serve` process: load, self-check, listen, stop on a signal
    app.py / control.py   HTTP routes (aiohttp), thin; control.py holds the RL/dev routes, text_routes.py
                          /tokenize, /detokenize and completion prompts
    protocol.py           request validation (vLLM shapes)
    responses.py          response bodies and their log-probs (vLLM shapes)
    engine.py             engine thread: commands, pause modes, delivery to the event loop; each step
                          launched before the previous one is recorded (--async-scheduling)
    scheduler.py          admission, chunked prefill, prefix reuse, preemption; blocks behind the
                          window of a model windowed on every layer are released
    sequence.py           one generated continuation: its tokens (some still on the device), stop rules
    runner.py             one step -> one forward pass -> sampled tokens, queued for the host
    step_rows.py          a step's rows of the decode attention (decode tokens, short prompt chunks' tokens)
    step_output.py        a step's sampled tokens on their way to the host (one transfer) and into sequences
    host_copy.py          step inputs to the device through page-locked memory, without waiting for it
    kv_cache.py           paged K/V pools and the attention function registered with transformers
    prefix_cache.py       block pool: reference counts, content-addressed full blocks, LRU eviction
    context_attention.py  chunks that continue after cached tokens attend over the paged cache
    varlen_attention.py   prompt chunks packed for FlashAttention's variable-length kernel (CUDA, half)
    attention_math.py     masked attention with sliding windows and logit soft-capping
    recurrent_state.py    per-sequence state of a hybrid's Gated DeltaNet layers and their step forward
    decode_attention.py   paged decode attention: a Triton kernel on CUDA (split context, merged partial
                          softmaxes), a gather path elsewhere; load-time checks pick the path
    decode_kernels.py     its Triton kernels (per-sequence, shared-prefix, merge) and their launch
    shared_prefix.py      decode sequences whose first blocks are the same (a GRPO group's prompt),
                          read once per group by decode attention
    step_graphs.py        fixed-shape steps replayed as CUDA graphs: decode rows, short prompt chunks
                          as rows, a hybrid's recurrent state slots, LoRA slots
    fused_layers.py / fused_norm.py  Llama-family attention/MLP blocks and RMSNorm as fused kernels,
                          each used only after a load-time accuracy check
    sampling.py           pure sampling math (min_p/top_k/top_p, processed log-probs, seeded race)
    weights.py            weight-transfer state machine and in-place loading by checkpoint name
    metrics.py            Prometheus series with vLLM's names
    profiling.py          /start_profile, /stop_profile: the torch profiler over the engine thread
    loading.py            model (a vision-language checkpoint's text model), dtype, context length, EOS
                          ids, KV-cache size; refuses what it would serve wrongly
    self_check.py         load-time check: engine log-probs == the model's own forward, else refused
    lease.py / holding.py the trainer lease: one trainer holds the server; pauses and half-done updates expire
    lora.py               LoRA adapters (--enable-lora): stacked slot weights, the batched delta, slot ownership
    lora_files.py         reading and checking a PEFT adapter directory
    lora_routes.py        /v1/load_lora_adapter, /v1/unload_lora_adapter, adapter cards, `model` -> adapter
"""
