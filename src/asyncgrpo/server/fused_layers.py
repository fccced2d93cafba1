"""The attention and MLP blocks of Llama-family layers in fewer kernels (the served model).

At decode batch sizes a forward pass costs a few microseconds per kernel whatever the kernel's size,
and the Hugging Face blocks launch many small ones: three projections for q, k and v, Qwen3's two
per-head norms, ten for the rotary embedding (a multiply, a slice, a negation, a concatenation, a
multiply and an add, for q and for k), and in the MLP two projections, the activation and a
multiply. `fuse_layers` gives each attention and MLP module a forward with the same arithmetic in
fewer kernels:

    q, k, v projections      one matmul over the concatenated weights
    q/k norm + rotary        one kernel over every q and k head of the step (Triton, CUDA)
    gate, up projections     one matmul
    SiLU(gate) * up          one kernel (Triton, CUDA)

The concatenated weights are the storage of the modules' own parameters (these become views of
them), so weight updates, which copy into the parameters in place, land there. A module gets the
new forward only if, on random input, it computes the module's output as accurately as the module's
own forward (`fused_norm.as_accurate`: both against the module run in float32); other definitions (a
partial rotary embedding, another activation, a norm of another formula) keep their own. Without
Triton (CPU) only the matmuls are merged; the norms and the rotary embedding run as the modules
define them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from asyncgrpo.server.attention_math import module_window
from asyncgrpo.server.fused_norm import as_accurate

logger = logging.getLogger(__name__)


@functools.cache
def _triton_kernels():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def norm_rope_kernel(qkv_ptr, stride_row, norm_w_ptr, cos_ptr, sin_ptr, stride_cs, out_ptr, eps,
                         slots_ptr, k_cache_ptr, v_cache_ptr,
                         NUM_Q: tl.constexpr, NUM_QK: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HAS_NORM: tl.constexpr, WRITE_CACHE: tl.constexpr):
        # one program per (token, q or k head); every product is rounded to the model dtype where
        # the module's forward rounds it
        row = tl.program_id(0)
        head = tl.program_id(1)
        HALF: tl.constexpr = HEAD_DIM // 2
        cols = tl.arange(0, HALF)
        src = qkv_ptr + row * stride_row + head * HEAD_DIM
        x1 = tl.load(src + cols)
        x2 = tl.load(src + HALF + cols)
        dt = x1.dtype
        if HAS_NORM:
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            rstd = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / HEAD_DIM + eps)
            w = norm_w_ptr + (head >= NUM_Q).to(tl.int32) * HEAD_DIM  # q's weight, then k's
            x1 = ((f1 * rstd).to(dt).to(tl.float32) * tl.load(w + cols).to(tl.float32)).to(dt)
            x2 = ((f2 * rstd).to(dt).to(tl.float32) * tl.load(w + HALF + cols).to(tl.float32)).to(dt)
        cs = row * stride_cs + cols
        c1, c2 = tl.load(cos_ptr + cs).to(tl.float32), tl.load(cos_ptr + cs + HALF).to(tl.float32)
        s1, s2 = tl.load(sin_ptr + cs).to(tl.float32), tl.load(sin_ptr + cs + HALF).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        o1 = ((a1 * c1).to(dt).to(tl.float32) - (a2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
        dst = out_ptr + (row * NUM_QK + head) * HEAD_DIM
        tl.store(dst + cols, o1)
        tl.store(dst + HALF + cols, o2)
        if WRITE_CACHE:  # noqa: SIM102 -- a compile-time switch around a run-time test
            if head >= NUM_Q:  # a k head: its rotated key and the matching value head go to the cache row
                kv_head = head - NUM_Q
                cache_row = tl.load(slots_ptr + row) * (NUM_QK - NUM_Q) * HEAD_DIM + kv_head * HEAD_DIM
                tl.store(k_cache_ptr + cache_row + cols, o1)
                tl.store(k_cache_ptr + cache_row + HALF + cols, o2)
                v_src = src + (NUM_QK - NUM_Q) * HEAD_DIM
                tl.store(v_cache_ptr + cache_row + cols, tl.load(v_src + cols))
                tl.store(v_cache_ptr + cache_row + HALF + cols, tl.load(v_src + HALF + cols))

    @triton.jit
    def silu_mul_kernel(gate_up_ptr, stride_row, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=mask, other=0.0)
        up = tl.load(gate_up_ptr + row * stride_row + n_cols + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        tl.store(out_ptr + row * n_cols + cols, out, mask=mask)

    return norm_rope_kernel, silu_mul_kernel


def norm_rope(
    qkv: torch.Tensor,
    num_q: int,
    num_kv: int,
    head_dim: int,
    norm_weights: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (if `norm_weights`, q's then k's, [2 * head_dim]) and the rotate-half rotary
    embedding of the q and k heads of `qkv` [N, (num_q + 2 * num_kv) * head_dim] (rows: tokens; the
    heads of q, k, then v), in one Triton kernel. cos, sin: [N, head_dim].
    `cache` = (k pool, v pool, slot_mapping [N]): also write each token's rotated keys and its values
    into row slot_mapping[i] of the pools ([num_blocks, block_size, num_kv, head_dim], contiguous).
    Returns q [N, num_q, head_dim] and k [N, num_kv, head_dim], views of one new tensor."""
    norm_rope_kernel, _ = _triton_kernels()
    n = qkv.shape[0]
    assert qkv.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert qkv.shape[1] == (num_q + 2 * num_kv) * head_dim
    out = torch.empty(n, num_q + num_kv, head_dim, dtype=qkv.dtype, device=qkv.device)
    k_pool, v_pool, slots = cache if cache is not None else (out, out, out)
    if cache is not None:
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.shape[-2:] == (num_kv, head_dim)
    if n:
        norm_rope_kernel[(n, num_q + num_kv)](
            qkv, qkv.stride(0), norm_weights if norm_weights is not None else qkv, cos, sin, cos.stride(0),
            out, eps, slots, k_pool, v_pool, NUM_Q=num_q, NUM_QK=num_q + num_kv, HEAD_DIM=head_dim,
            HAS_NORM=norm_weights is not None, WRITE_CACHE=cache is not None,
        )
    return out[:, :num_q], out[:, num_q:]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of `gate_up` [N, 2 * I] (gate columns first) -> [N, I], in one Triton kernel."""
    _, silu_mul_kernel = _triton_kernels()
    n, width = gate_up.shape
    assert gate_up.stride(-1) == 1
    out = torch.empty(n, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = 1024
        silu_mul_kernel[(n, -(-(width // 2) // block))](gate_up, gate_up.stride(0), out, width // 2,
                                                         BLOCK=block)
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _share_storage(joined: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    """Make each parameter a view of its rows of `joined` (their concatenation along dim 0)."""
    start = 0
    for p in params:
        p.data = joined[start : start + p.shape[0]]
        start += p.shape[0]


@dataclass
class _Attention:
    """What the fused attention forward needs besides the module (built once at load time)."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    num_q: int
    num_kv: int
    norm_weights: torch.Tensor | None  # q_norm's then k_norm's weight (the Triton path)
    norm_eps: float
    triton: bool


def _attention_forward(
    module: torch.nn.Module,
    fused: _Attention,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)  # the paged attention keeps its own cache
    input_shape = hidden_states.shape[:-1]
    d = module.head_dim
    qkv = F.linear(hidden_states, fused.qkv_weight, fused.qkv_bias)
    if module.joined_lora is not None:  # LoRA adapters of q/k/v (server/lora.py)
        qkv = module.joined_lora(hidden_states, qkv)
    qkv = qkv.view(-1, fused.qkv_weight.shape[0])
    cos, sin = (t.expand(*input_shape, d).reshape(-1, d) for t in position_embeddings)
    if fused.triton:
        # inside the server's steps the kernel also writes this step's keys and values to the paged cache
        meta = kwargs.get("kv_meta")
        cache = None
        if meta is not None:
            cache = (meta.cache.k[module.layer_idx], meta.cache.v[module.layer_idx], meta.slot_mapping)
            kwargs["kv_written"] = True
        q, k = norm_rope(qkv, fused.num_q, fused.num_kv, d, fused.norm_weights, fused.norm_eps, cos, sin,
                         cache)
    else:
        q = qkv[:, : fused.num_q * d].view(-1, fused.num_q, d)
        k = qkv[:, fused.num_q * d : (fused.num_q + fused.num_kv) * d].view(-1, fused.num_kv, d)
        if getattr(module, "q_norm", None) is not None:
            q, k = module.q_norm(q), module.k_norm(k)
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    v = qkv[:, (fused.num_q + fused.num_kv) * d :].view(-1, fused.num_kv, d)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # [N, heads, D] -> [batch, heads, T, D]
        return x.view(*input_shape, x.shape[1], d).transpose(1, 2)

    attend: Callable = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
    out, weights = attend(
        module, heads_first(q), heads_first(k), heads_first(v), attention_mask,
        dropout=0.0, scaling=module.scaling, sliding_window=module_window(module), **kwargs,
    )
    return module.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _mlp_forward(
    module: torch.nn.Module, gate_up_weight: torch.Tensor, triton: bool, x: torch.Tensor
) -> torch.Tensor:
    gate_up = F.linear(x, gate_up_weight)
    if module.joined_lora is not None:  # LoRA adapters of gate/up (server/lora.py)
        gate_up = module.joined_lora(x, gate_up)
    if triton:
        act = silu_mul(gate_up.view(-1, gate_up.shape[-1])).view(*x.shape[:-1], -1)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = module.act_fn(gate) * up
    return module.down_proj(act)


def _is_linear(module: object) -> bool:
    return isinstance(module, torch.nn.Linear)


@dataclass
class _Fusion:
    """A fused forward, the concatenated tensors it reads with the parameters that become their
    views, and whether it runs the Triton kernels."""

    forward: Callable
    shares: list[tuple[torch.Tensor, list[torch.nn.Parameter]]]
    triton: bool
    parts: tuple[str, ...]  # the projections whose outputs the joined matmul concatenates, in order


def _fuse_attention(module: torch.nn.Module, triton: bool) -> _Fusion | None:
    """The fused forward of a Llama-family attention module, or None if it does not have that shape."""
    projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    d = getattr(module, "head_dim", None)
    if not (all(map(_is_linear, projections)) and _is_linear(getattr(module, "o_proj", None))
            and isinstance(d, int) and d % 2 == 0 and isinstance(getattr(module, "layer_idx", None), int)
            and hasattr(module, "scaling") and hasattr(module, "config")):
        return None
    if len({p.bias is None for p in projections}) != 1:
        return None
    norms = [getattr(module, "q_norm", None), getattr(module, "k_norm", None)]
    if (norms[0] is None) != (norms[1] is None):
        return None
    has_norm = norms[0] is not None
    eps = getattr(norms[0], "variance_epsilon", None)
    if has_norm and not (isinstance(eps, float) and eps == getattr(norms[1], "variance_epsilon", None)
                         and all(getattr(n, "weight", torch.empty(0)).shape == (d,) for n in norms)):
        return None
    shares = [(torch.cat([p.weight.detach() for p in projections]), [p.weight for p in projections])]
    if projections[0].bias is not None:
        shares.append((torch.cat([p.bias.detach() for p in projections]), [p.bias for p in projections]))
    if has_norm:
        shares.append((torch.cat([n.weight.detach() for n in norms]), [n.weight for n in norms]))
    fused = _Attention(
        qkv_weight=shares[0][0],
        qkv_bias=shares[1][0] if projections[0].bias is not None else None,
        num_q=projections[0].out_features // d,
        num_kv=projections[1].out_features // d,
        norm_weights=shares[-1][0] if has_norm else None,
        norm_eps=eps if has_norm else 0.0,
        # the kernel takes head_dim / 2 lanes: a power of two
        triton=triton and projections[0].weight.is_cuda and d >= 32 and d & (d - 1) == 0,
    )
    return _Fusion(functools.partial(_attention_forward, module, fused), shares, fused.triton,
                   ("q_proj", "k_proj", "v_proj"))


def _fuse_mlp(module: torch.nn.Module, triton: bool) -> _Fusion | None:
    projections = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not (all(map(_is_linear, projections)) and all(p.bias is None for p in projections)
            and callable(getattr(module, "act_fn", None))):
        return None
    gate_up = [projections[0].weight, projections[1].weight]
    joined = torch.cat([p.detach() for p in gate_up])
    triton = triton and joined.is_cuda
    return _Fusion(functools.partial(_mlp_forward, module, joined, triton), [(joined, gate_up)], triton,
                   ("gate_proj", "up_proj"))


def _check_inputs(module: torch.nn.Module, attention: bool) -> tuple:
    """Random inputs of a 5-token prompt (the attention module also gets a rotary embedding and no mask)."""
    first = module.q_proj if attention else module.gate_proj
    device, dtype = first.weight.device, first.weight.dtype
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, 5, first.in_features, generator=g, device=device).to(dtype)
    if not attention:
        return (x,)
    angles = torch.rand(1, 5, module.head_dim // 2, generator=g, device=device) * 6.3
    angles = torch.cat([angles, angles], dim=-1)
    return x, (angles.cos().to(dtype), angles.sin().to(dtype)), None


def _checked(module: torch.nn.Module, attention: bool, fusion: _Fusion) -> bool:
    """Whether the fused forward passes `as_accurate` on random input (raises if it fails to run)."""
    config = module.config if attention else None
    impl = config._attn_implementation if attention else None
    try:
        inputs = _check_inputs(module, attention)
        if attention:  # the check runs outside the server's steps: plain causal attention
            config._attn_implementation = "sdpa"
            try:
                module(*inputs)
            except ValueError:
                # SDPA refuses one of the module's options (soft-capping): keep its own forward
                return False
        return as_accurate(module, fusion.forward, *inputs)
    finally:
        if attention:
            config._attn_implementation = impl


@dataclass(frozen=True)
class FusedLayers:
    """What `fuse_layers` did: how many attention and MLP modules got the fused forward, and how many
    of those run the Triton kernels."""

    attention: int = 0
    mlp: int = 0
    with_triton: int = 0


def fuse_layers(model: torch.nn.Module, triton: bool) -> FusedLayers:
    """Give the attention and MLP modules of `model` their fused forwards (see the module docstring);
    `triton`: use the Triton kernels (CUDA; if they fail to compile, the matmuls are still merged).
    The check runs each module on a short causal prompt through PyTorch's SDPA. Returns how many
    modules were fused."""
    triton = triton and _triton_kernels() is not None
    attention_count = mlp_count = triton_count = 0
    kept: set[str] = set()
    for module in list(model.modules()):
        for attention, fuse in ((True, _fuse_attention), (False, _fuse_mlp)):
            fusion = fuse(module, triton)
            if fusion is None:
                continue
            module.joined_lora = None  # LoRA's hook on the joined output (set by server/lora.py)
            try:
                same = _checked(module, attention, fusion)
            except Exception as exc:
                if not triton:
                    raise
                logger.warning("the fused attention/MLP kernels do not run on this GPU (%s); only their "
                               "matmuls are merged", exc)
                triton = False
                fusion = fuse(module, triton)
                same = _checked(module, attention, fusion)
            if not same:
                kept.add(type(module).__name__)
                continue
            for joined, params in fusion.shares:
                _share_storage(joined, params)
            module.forward = fusion.forward
            module.joined_projections = fusion.parts
            attention_count += attention
            mlp_count += not attention
            triton_count += fusion.triton
    if kept:
        logger.info("%s compute something else than the fused forward: they keep their own", sorted(kept))
    return FusedLayers(attention_count, mlp_count, triton_count)
