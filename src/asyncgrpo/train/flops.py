"""Model FLOPs of a training step, and the device peak they are compared with (`perf/*_mfu`).

FLOP model (forward + backward = 3 x forward; no credit for recomputation, padding or duplicated
work), for one packed row of T forwarded tokens, N trained tokens and P attended (query, key) pairs:

    6 * N_layers_params * T          every decoder-layer matmul, each forwarded token once
  + 6 * V * H * N                    the LM head, run only at the trained positions
  + 12 * L * heads * head_dim * P    attention scores and values (QK^T and PV), forward + backward

`N_layers_params` counts the parameters under the decoder layers; for a Mixture-of-Experts model only
the active ones (the routed experts' parameters scaled by top_k / num_experts). Models with
sliding-window layers or with mixing layers other than attention are not modelled (their attended
pairs are not P): `FlopModel.for_model` returns None and no MFU is logged.

The peak is the device's dense tensor-core peak at the training precision, from its datasheet
(`PEAK_TFLOPS`); fp32 training, CPUs and unknown devices have none, and no MFU is logged. It is the
conventional MFU denominator, and bench/packing.py divides by the same figure. It is not what a matmul
reaches: on the H200 measured here one 8192^3 bf16 matmul runs at about 790 TFLOP/s against the
datasheet's 989.4 (clocks under load), so a perfect step would show about 80% MFU; the benchmark
reports that ratio too (`mfu_of_matmul`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PEAK_TFLOPS", "FlopModel", "peak_flops"]

DELTA_RULE_CHUNK = 64  # the chunk length of the chunked gated delta rule (fla-core and the PyTorch path)

# Dense bf16/fp16 tensor-core TFLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
# Checked in order: the first match wins.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 4090", 165.2),
    ("MI300X", 1307.4),
    ("MI250X", 383.0),
)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of `device` for matmuls in `dtype`; None when unknown (CPU, fp32, unlisted GPU)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


@dataclass(frozen=True)
class FlopModel:
    """The module docstring's FLOP model for one architecture."""

    layer_params: int
    vocab_size: int
    hidden_size: int
    attention_per_pair: int  # 12 * full-attention layers * heads * head_dim
    recurrent_per_token: int = 0  # a hybrid's chunked gated delta rule, forward + backward

    @classmethod
    def for_config(cls, config, layer_params: int) -> FlopModel | None:
        """The FLOP model of a (text) config whose decoder layers hold `layer_params` (active) parameters;
        None where it does not apply (see the module docstring)."""
        layer_types = list(getattr(config, "layer_types", None)
                           or ["full_attention"] * config.num_hidden_layers)
        if set(layer_types) - {"full_attention", "linear_attention"}:
            return None  # sliding-window or other mixing layers
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        recurrent = 0
        if "linear_attention" in layer_types:
            k, v = config.linear_key_head_dim, config.linear_value_head_dim
            per_head = 6 * (DELTA_RULE_CHUNK * (2.5 * k + 1.5 * v) + 3 * k * v)
            recurrent = int(layer_types.count("linear_attention") * config.linear_num_value_heads * per_head)
        return cls(
            layer_params=layer_params,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            attention_per_pair=(12 * layer_types.count("full_attention") * config.num_attention_heads
                                * head_dim),
            recurrent_per_token=recurrent,
        )

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> FlopModel | None:
        """The FLOP model of a loaded model: its decoder-layer parameters counted (active experts only)."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        layer_params = 0
        for name, param in model.named_parameters():
            if ".layers." not in name:
                continue
            count = param.numel()
            if num_experts and top_k and ".experts." in name:
                count = count * top_k // num_experts
            layer_params += count
        return cls.for_config(config, layer_params)

    def step_flops(self, forwarded_tokens: int, trained_tokens: int, attention_pairs: int) -> float:
        """Forward + backward FLOPs of rows with these totals."""
        return float(
            (6 * self.layer_params + self.recurrent_per_token) * forwarded_tokens
            + 6 * self.vocab_size * self.hidden_size * trained_tokens
            + self.attention_per_pair * attention_pairs
        )
