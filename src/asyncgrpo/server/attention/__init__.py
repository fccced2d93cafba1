"""Attention of the embedded server's steps: one backend per segment kind, chosen once into a plan.

    base.py           segments, kinds, `Support` (what a backend declares), `AttentionBackend`, `PlanFlags`
    plan.py           `ExecutionPlan`: KINDS (the probe's lines), `resolve_plan`, a step's segments,
                      graph keys
    decode.py         decode: paged decode rows (Triton kernel, or the gather), its load-time checks
    shared_prefix.py  decode_shared: rows whose first blocks are the same, read once per group; finding them
    fresh.py          fresh: prompt chunks from token 0 (packed for FlashAttention, or padded)
    rows.py           rows: short chunks after cached tokens as decode rows (a layout the decode backends run)
    continued.py      continued: chunks after cached tokens (packed for FlashAttention, or padded)
    varlen.py         the packed layout and FlashAttention's variable-length kernel, its reference and check

Adding a layout: one file (a backend: what it supports, which chunks it takes, how it lays them out and
computes them) and one line in `plan.KINDS`.
"""
