"""The elementwise part of the chunked log-prob head, in a form a compiler fuses (`fused=True`).

`asyncgrpo.train.logprobs` multiplies a chunk of C trained positions' hidden states by the LM head,
x = h @ W^T (+ b) in the weight's dtype, [C, V]. Everything after that matmul is memory-bound: the
unfused path casts x to fp32 and makes a dozen full [C, V] fp32 passes per chunk (softcap,
temperature, logsumexp, softmax, entropy; in backward the softmax again, two scatters, the chain
rule, the cast back), which on a 150k vocabulary costs more time than the matmul itself.

Here the dense work is written as one reduction (forward) and one pointwise map (backward) over x,
which `torch.compile` turns into a kernel or two that read x once per pass and keep fp32 in
registers; the sparse terms (the target and top-K tokens, K + 1 per position) are computed on the
gathered [C, K + 1] values and added through a small gather / index_add instead of scattering into a
[C, V] buffer. Same definitions as `logprobs.py` (z = cap * tanh(x * scale / cap) / temperature):

    forward   lse = logsumexp_v z_v,   entropy = lse - sum_v softmax(z)_v z_v,   z at target / top-K
    backward  dL/dx_v = (scale / T) * cap'(x_v) * (sum_j g_j [v = id_j] - g_row * softmax(z)_v)

The functions are compiled on CUDA (once per logit processing; the chunk length is dynamic) and run
eagerly elsewhere, so CPU tests check the very formulas the GPU runs. Candidate sets (top_p / min_p)
keep the unfused path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["backward_chunks", "chunk_logit_grad", "chunk_stats", "forward_chunks", "fused_kernels",
           "sparse_logit_grads"]


def _processed(x: Tensor, scale: float, temperature: float, softcap: float | None) -> Tensor:
    """Raw logits in any dtype -> fp32 (or fp64) processed logits z."""
    z = x.to(torch.promote_types(x.dtype, torch.float32))
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z / temperature if temperature != 1.0 else z


def chunk_stats(x: Tensor, scale: float, temperature: float, softcap: float | None) -> tuple[Tensor, Tensor]:
    """(logsumexp [C], entropy [C]) of the processed logits of raw logits `x` [C, V]."""
    z = _processed(x, scale, temperature, softcap)
    peak = z.amax(dim=-1, keepdim=True)
    e = torch.exp(z - peak)
    total = e.sum(dim=-1)
    lse = peak.squeeze(-1) + torch.log(total)
    entropy = lse - (e * z).sum(dim=-1) / total
    return lse, entropy


def processed_at(x: Tensor, ids: Tensor, scale: float, temperature: float, softcap: float | None) -> Tensor:
    """Processed logits at token `ids` [C, J] (any J), from raw logits `x` [C, V]."""
    return _processed(x.gather(1, ids), scale, temperature, softcap)


def chunk_logit_grad(x: Tensor, lse: Tensor, grad_row: Tensor, scale: float, temperature: float,
                     softcap: float | None) -> Tensor:
    """The dense part of dL/dx, `-(scale / T) cap'(x) g_row softmax(z)`, [C, V] in x's dtype.
    `lse` [C] is the logsumexp the forward normalised by; `grad_row` [C] the sum of the gradients of
    every log-prob of the row (each one is z_id - lse)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xs = x.to(acc) * scale if scale != 1.0 else x.to(acc)
    if softcap is not None:
        t = torch.tanh(xs / softcap)
        z, dcap = t * softcap, 1.0 - t * t
    else:
        z, dcap = xs, None
    if temperature != 1.0:
        z = z / temperature
    g = torch.exp(z - lse[:, None]) * (-grad_row[:, None] * (scale / temperature))
    if dcap is not None:
        g = g * dcap
    return g.to(x.dtype)


def sparse_logit_grads(x_at: Tensor, grad_at: Tensor, scale: float, temperature: float,
                       softcap: float | None) -> Tensor:
    """The sparse part of dL/dx at the gathered tokens: `(scale / T) cap'(x) g_j` [C, J] in the
    accumulation dtype, from raw logits `x_at` and log-prob gradients `grad_at` there [C, J]."""
    acc = torch.promote_types(x_at.dtype, torch.float32)
    g = grad_at.to(acc) * (scale / temperature)
    if softcap is not None:
        t = torch.tanh(x_at.to(acc) * scale / softcap)
        g = g * (1.0 - t * t)
    return g


@functools.cache
def _compiled(name: str):
    fn = {"stats": chunk_stats, "grad": chunk_logit_grad}[name]
    return torch.compile(fn, fullgraph=True)


def fused_kernels(device: torch.device) -> tuple:
    """(chunk_stats, chunk_logit_grad): compiled on CUDA, the plain functions elsewhere."""
    if device.type == "cuda":
        return _compiled("stats"), _compiled("grad")
    return chunk_stats, chunk_logit_grad


def forward_chunks(h, weight, bias, target_ids, safe_topk, temperature, scale, softcap, chunk_size,
                   lse, target_lp, topk_lp, entropy):
    """`logprobs._ChunkedLogprobs.forward` without candidate sets: fills `lse`, `target_lp`, `topk_lp`,
    `entropy` chunk by chunk."""
    stats, _ = fused_kernels(h.device)
    for start in range(0, h.shape[0], chunk_size):
        stop = min(start + chunk_size, h.shape[0])
        x = F.linear(h[start:stop].to(weight.dtype), weight, bias)
        lse_c, entropy[start:stop] = stats(x, scale, temperature, softcap)
        lse[start:stop] = lse_c
        target_lp[start:stop] = (
            processed_at(x, target_ids[start:stop, None], scale, temperature, softcap)[:, 0] - lse_c
        )
        if safe_topk.shape[1]:
            topk_lp[start:stop] = (
                processed_at(x, safe_topk[start:stop], scale, temperature, softcap) - lse_c[:, None]
            )


def backward_chunks(h, weight, bias, target_ids, safe_topk, lse, grad_row, grad_target, grad_topk,
                    temperature, scale, softcap, chunk_size, grad_h, grad_w, grad_b):
    """`logprobs._ChunkedLogprobs.backward` without candidate sets, accumulating into `grad_*` (None: not
    needed): the dense softmax term of each chunk's logit gradient in the weight's dtype, the target and
    top-K terms in fp32 on their K + 1 tokens (gradients of invalid top-K entries are zero already)."""
    _, dense_grad = fused_kernels(h.device)
    acc = torch.promote_types(weight.dtype, torch.float32)
    for start in range(0, h.shape[0], chunk_size):
        stop = min(start + chunk_size, h.shape[0])
        hc = h[start:stop].to(weight.dtype)
        x = F.linear(hc, weight, bias)
        gx = dense_grad(x, lse[start:stop], grad_row[start:stop], scale, temperature, softcap)
        ids = torch.cat([target_ids[start:stop, None], safe_topk[start:stop]], dim=1)  # [C, K + 1]
        g_at = torch.cat([grad_target[start:stop, None], grad_topk[start:stop]], dim=1)
        sparse = sparse_logit_grads(x.gather(1, ids), g_at, scale, temperature, softcap)
        del x
        if grad_h is not None:
            rows = torch.bmm(sparse[:, None, :], weight[ids].to(acc))[:, 0]  # sum_j s_j W[id_j], [C, H]
            grad_h[start:stop] = ((gx @ weight).to(acc) + rows).to(h.dtype)
        if grad_w is not None:
            grad_w += (gx.t() @ hc).to(acc)
            grad_w.index_add_(0, ids.reshape(-1), (sparse[:, :, None] * hc.to(acc)[:, None, :]).flatten(0, 1))
        if grad_b is not None:
            grad_b += gx.sum(dim=0, dtype=acc)
            grad_b.index_add_(0, ids.reshape(-1), sparse.reshape(-1))
