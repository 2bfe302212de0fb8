"""The Qwen2 model maths of the fast engine, as functions of tensors (no module, no cache object).

A decode step (``decode_math``: embed, every layer for one new token per row, the LM head, sampling),
a prompt's forward (``prefill_math``) and new prompt tokens over cached K/V (``extend_math``), over
the tensor list of ``weights.FusedWeights``. The layer functions (``make_layer_step``,
``make_prefill_layer``, ``make_extend_layer``) take a ``compile_fn``: ``torch.compile`` on a GPU, where
``generator`` also captures the step as a CUDA graph; without one the same maths runs eagerly (CPU, tests).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from talkmethods.engines.fast import attention as da
from talkmethods.engines.fast.sampler import sample
from talkmethods.engines.fast.weights import Arch
from talkmethods.engines.sampling import Sampling


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm, rounding where transformers rounds."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; for a cohort's stacked weights ``(W⊕A, Bᵀ)`` (``weights.StackedWeights``) the base
    product over every row plus each row group's own LoRA product. Rows come in ``S`` equal groups,
    group ``s`` on adapter ``s``. ``W⊕A`` is the base matrix with every adapter's ``A`` (r rows each)
    below it, so one product reads the base weights once for all the adapters' rows and gives every
    row's ``A`` products beside (each row keeps its own group's, a strided view); ``Bᵀ`` (S, r, out),
    the scaling folded in, then adds each group's LoRA into its base product (one ``baddbmm``). Two
    launches a projection where three or four small ones cost ~1.2 ms a decode step at 96 rows (H100).
    """
    if not isinstance(w, tuple):
        return F.linear(x, w, b)
    wa, b_t = w
    groups, rank, out = b_t.shape
    y = F.linear(x, wa, b).reshape(groups, -1, out + groups * rank)  # (S, n, out + S·r)
    # group s's rows under adapter s: columns out + s·r ... out + (s + 1)·r, as views (the diagonal of
    # groups by adapters)
    u = y[..., out:].unflatten(-1, (groups, rank)).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    return torch.baddbmm(y[..., :out], u, b_t).view(*x.shape[:-1], out)


def _rope_tables(inv_freq, scale, positions, dtype):
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _qkv(x, in_norm, qkv_w, qkv_b, arch: Arch):
    """The attention block's normed input projected to q, k and v (one fused matmul)."""
    d = arch.head_dim
    qkv = _linear(_rms_norm(x, in_norm, arch.eps), qkv_w, qkv_b)
    return qkv.split([arch.heads * d, arch.kv_heads * d, arch.kv_heads * d], dim=-1)


def _mlp_residual(x, post_norm, gu_w, down_w, eps: float):
    """``x`` plus Qwen2's SwiGLU MLP of its norm (gate and up in one fused matmul)."""
    gate, up = _linear(_rms_norm(x, post_norm, eps), gu_w).chunk(2, dim=-1)
    return x + _linear(F.silu(gate) * up, down_w)


def _rotate(x, cos, sin):
    half = x.size(-1) // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


ATTENTION_FORMS = ("matmul", "sdpa", "triton")  # the forms ``attention="auto"`` chooses from


def make_layer_step(arch: Arch, attention: str = "matmul", compile_fn=None, sms: int = 132, compile_ends: bool = True):
    """``_layer_step``'s layer; with ``compile_fn`` it also carries the step's two ends compiled (``ends``).

    The ends (embedding and RoPE tables; the final norm and the LM head) are ~20 small launches a
    step when eager; compiled, a few. ``compile_ends=False`` leaves them eager beside a compiled
    layer (the A/B of docs/speed_h200.md, ``bench/ab.py sampler-ends``).
    """
    layer_step = _layer_step(arch, attention, compile_fn, sms)
    if compile_fn is not None and compile_ends:
        layer_step.ends = (compile_fn(step_start), compile_fn(head_logits))
    return layer_step


def _layer_step(arch: Arch, attention: str, compile_fn, sms: int):
    """One transformer layer for one new token per row; ``compile_fn`` (``torch.compile`` on a GPU) wraps its maths.

    ``x``: (B, H) hidden states; ``cos``/``sin``: (B, 1, d); ``blocked``: (B, 1, 1, S) cache columns a
    row may not see; ``col``: (1,) the token's cache column; ``k_cache``/``v_cache``: (B, kv, S, d)
    views. Returns the new ``x`` and the token's K/V (B, kv, d), which the caller writes into the cache.

    Forms of the attention over the cache: ``matmul`` reads the cache without the new token (two
    products) and adds its own score beside (no mutation inside the compiled code, which would copy
    the cache); ``sdpa`` writes the token's K/V first and runs one fused attention kernel over the
    cache, so the layer is two compiled pieces around the write; ``triton`` (GPU only) is one split-KV
    kernel that writes the token's K/V and attends to the columns in use (``attention``), between
    the same two compiled pieces, and takes each row's first real column instead of a mask. With GQA
    the ``g`` query heads of a KV head act as ``g`` query rows of that head, so no K/V is repeated.
    """
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"unknown attention form {attention!r}; one of {ATTENTION_FORMS}")
    heads, kv_heads, d, eps = arch.heads, arch.kv_heads, arch.head_dim, arch.eps
    g, scale = heads // kv_heads, 1.0 / math.sqrt(arch.head_dim)
    wrap = compile_fn or (lambda f: f)

    def project(x, cos, sin, in_norm, qkv_w, qkv_b):
        n_rows = x.size(0)
        q, k, v = _qkv(x, in_norm, qkv_w, qkv_b, arch)
        q = _rotate(q.view(n_rows, heads, d), cos, sin).view(n_rows, kv_heads, g, d)
        return q, _rotate(k.view(n_rows, kv_heads, d), cos, sin), v.view(n_rows, kv_heads, d)

    def finish(x, att, o_w, post_norm, gu_w, down_w):
        x = x + _linear(att.reshape(x.size(0), heads * d), o_w)
        return _mlp_residual(x, post_norm, gu_w, down_w, eps)

    if attention == "sdpa":

        def attend(x, q, allowed, k_cache, v_cache, o_w, post_norm, gu_w, down_w):
            att = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=allowed, scale=scale)
            return finish(x, att, o_w, post_norm, gu_w, down_w)

        project_c, attend_c = wrap(project), wrap(attend)

        def layer_step(
            x, cos, sin, allowed, col, k_cache, v_cache, in_norm, qkv_w, qkv_b, o_w, post_norm, gu_w, down_w
        ):
            q, k, v = project_c(x, cos, sin, in_norm, qkv_w, qkv_b)
            k_cache.index_copy_(2, col, k[:, :, None])
            v_cache.index_copy_(2, col, v[:, :, None])
            return attend_c(x, q, allowed, k_cache, v_cache, o_w, post_norm, gu_w, down_w), None, None

        layer_step.sees_own_column = True  # takes the columns it may see (``col`` included); writes the cache
        return layer_step

    if attention == "triton":
        # Fewer launches a layer: the kernel turns q and k by RoPE itself, and no residual add meets a
        # matmul (inductor would make it an ``addmm``, which first copies the residual: a memcpy per
        # matmul). The o-projection's add runs in the next norm's kernel, the MLP's in the next layer's.
        def project_raw(x, delta, in_norm, qkv_w, qkv_b):
            x = x + delta
            n_rows = x.size(0)
            q, k, v = _qkv(x, in_norm, qkv_w, qkv_b, arch)
            return x, q.view(n_rows, kv_heads, g, d), k.view(n_rows, kv_heads, d), v.view(n_rows, kv_heads, d)

        def finish_apart(x, att, o_w, post_norm, gu_w, down_w):
            x = (x.float() + _linear(att.reshape(x.size(0), heads * d), o_w).float()).to(x.dtype)  # = the bf16 add
            gate, up = _linear(_rms_norm(x, post_norm, eps), gu_w).chunk(2, dim=-1)
            return x, _linear(F.silu(gate) * up, down_w)

        project_c, finish_c = wrap(project_raw), wrap(finish_apart)

        def layer_step(
            carry, cos, sin, bounds, col, k_cache, v_cache, in_norm, qkv_w, qkv_b, o_w, post_norm, gu_w, down_w
        ):
            x, q, k, v = project_c(*carry, in_norm, qkv_w, qkv_b)
            splits = da.split_count(x.size(0), kv_heads, k_cache.size(2), sms)
            pad_start, hole, counters = bounds
            att = da.decode_attention(
                q, k, v, k_cache, v_cache, pad_start, col, scale, splits, hole, cos, sin, counters
            )
            return finish_c(x, att, o_w, post_norm, gu_w, down_w), None, None

        layer_step.sees_own_column = True
        layer_step.takes_bounds = True  # no mask: the kernel reads columns [pad_start, col] outside the hole
        layer_step.carries_residual = True  # x is (residual, its pending add); cos/sin (B, d) go to the kernel
        return layer_step

    def fused(x, cos, sin, blocked, col, k_cache, v_cache, in_norm, qkv_w, qkv_b, o_w, post_norm, gu_w, down_w):
        q, k, v = project(x, cos, sin, in_norm, qkv_w, qkv_b)
        past = torch.matmul(q, k_cache.transpose(-1, -2)).float() * scale  # (B, kv, g, S)
        past = past.masked_fill(blocked, float("-inf"))
        own = (q.float() * k.float()[:, :, None, :]).sum(-1, keepdim=True) * scale  # (B, kv, g, 1)
        p = torch.softmax(torch.cat([past, own], dim=-1), dim=-1).to(x.dtype)
        att = torch.matmul(p[..., :-1], v_cache) + p[..., -1:] * v[:, :, None, :]
        return finish(x, att, o_w, post_norm, gu_w, down_w), k, v

    layer_step = wrap(fused)
    return layer_step


def visible(cols, pad_start, hole_lo, hole_hi, end):
    """Cache columns a query sees (broadcast): from its row's first real column, outside its hole, before ``end``."""
    return (cols >= pad_start) & ((cols < hole_lo) | (cols >= hole_hi)) & (cols < end)


def step_start(tok, pos, embed, inv_freq, rope_scale: float):
    """A decode step's input: the tokens' embeddings and their RoPE tables (B, d)."""
    x = F.embedding(tok, embed)
    cos, sin = _rope_tables(inv_freq, rope_scale, pos, x.dtype)
    return x, cos, sin


def head_logits(x, delta, norm_w, head_w, eps: float):
    """The LM head's logits of the last layer's output (``delta``: a pending residual add)."""
    if delta is not None:
        x = x + delta
    return F.linear(_rms_norm(x, norm_w, eps), head_w)


def decode_math(
    layer_step,
    w: list[torch.Tensor],
    inv_freq,
    rope_scale: float,
    eps: float,
    tok,
    pos,
    col,
    pad_start,
    hole,
    u,
    k_cache,
    v_cache,
    sampling: Sampling,
    counters=None,
):
    """One decode step for every row: the new token's K/V, the next token and its log-prob.

    ``tok``/``pos``/``pad_start``/``u``: (B,) current token, its RoPE position, the row's first real
    cache column, a uniform; ``hole``: (B, 2) cache columns ``[lo, hi)`` a row skips (a reused prefix's
    stale tail, see ``FastGenerator``; ``[0, 0)`` when none); ``col``: (1,) the cache column ``tok`` belongs to; ``k_cache``/``v_cache``:
    (L, B, kv, S, d) views (columns ``>= col`` are ignored; the ``sdpa`` form writes column ``col``);
    ``counters``: the batch's own split counters for the ``triton`` form (``attention``).
    Returns ``(next, logp, k, v)`` with ``k``/``v`` of shape (L, B, kv, d) for the caller to write into the cache
    (``None`` when the layers wrote them, the ``sdpa`` form).
    """
    start, head = getattr(layer_step, "ends", (step_start, head_logits))
    x, cos, sin = start(tok, pos, w[-2], inv_freq, rope_scale)
    own = getattr(layer_step, "sees_own_column", False)
    if getattr(layer_step, "takes_bounds", False):
        mask = (pad_start, hole, counters)
    else:
        cols = torch.arange(k_cache.size(3), device=tok.device)
        seen = visible(cols[None, :], pad_start[:, None], hole[:, :1], hole[:, 1:], col + 1 if own else col)[
            :, None, None, :
        ]
        mask = seen if own else ~seen  # the sdpa form takes the columns it may see, the others those it may not
    carries = getattr(layer_step, "carries_residual", False)
    if carries:
        x, rope = (x, torch.zeros_like(x)), (cos, sin)
    else:
        rope = (cos[:, None], sin[:, None])
    new_k, new_v = [], []
    for i in range(k_cache.size(0)):
        x, k, v = layer_step(x, *rope, mask, col, k_cache[i], v_cache[i], *w[7 * i : 7 * i + 7])
        if k is not None:
            new_k.append(k)
            new_v.append(v)
    x, delta = x if carries else (x, None)
    nxt, logp = sample(head(x, delta, w[-3], w[-1], eps), u, sampling)
    if not new_k:  # the layers wrote their K/V themselves
        return nxt, logp, None, None
    return nxt, logp, torch.stack(new_k), torch.stack(new_v)


def make_prefill_layer(arch: Arch, compile_fn=None):
    """One transformer layer over a left-padded prompt chunk: new ``x`` and the layer's K/V (B, kv, W, d).

    ``compile_fn`` (``torch.compile``, dynamic shapes, on a GPU) fuses its norms, RoPE and SwiGLU:
    eager, those passes over a 32k-token chunk are a large share of prefill time.
    """
    project, attend = _prompt_pieces(arch)

    def layer(x, cos, sin, allowed, in_norm, qkv_w, qkv_b, o_w, post_norm, gu_w, down_w):
        q, k, v = project(x, cos, sin, in_norm, qkv_w, qkv_b)
        return attend(x, q, k, v, allowed, o_w, post_norm, gu_w, down_w), k, v

    return compile_fn(layer) if compile_fn else layer


def _prompt_pieces(arch: Arch):
    """A prompt chunk's layer in two pieces: q/k/v of its tokens; attention over given K/V, then the MLP."""
    heads, kv_heads, d, eps = arch.heads, arch.kv_heads, arch.head_dim, arch.eps
    g = heads // kv_heads

    def project(x, cos, sin, in_norm, qkv_w, qkv_b):
        n_rows, width = x.shape[0], x.shape[1]
        q, k, v = _qkv(x, in_norm, qkv_w, qkv_b, arch)
        q = _rotate(q.view(n_rows, width, heads, d).transpose(1, 2), cos, sin)
        k = _rotate(k.view(n_rows, width, kv_heads, d).transpose(1, 2), cos, sin)
        return q, k, v.view(n_rows, width, kv_heads, d).transpose(1, 2)

    def attend(x, q, k, v, allowed, o_w, post_norm, gu_w, down_w):
        n_rows, width = x.shape[0], x.shape[1]
        att = F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=allowed
        )
        x = x + _linear(att.transpose(1, 2).reshape(n_rows, width, heads * d), o_w)
        return _mlp_residual(x, post_norm, gu_w, down_w, eps)

    return project, attend


def make_extend_layer(arch: Arch, compile_fn=None):
    """One layer over new prompt tokens that continue K/V already in the cache (a reused prefix).

    The chunk's K/V are written into cache columns ``[start, start + W)`` and its queries attend to
    columns ``[0, start + W)`` under ``allowed`` (B, 1, W, start + W). Two compiled pieces around
    the cache write, as the ``sdpa`` decode form.
    """
    project, attend = _prompt_pieces(arch)
    if compile_fn:
        project, attend = compile_fn(project), compile_fn(attend)

    def layer(x, cos, sin, allowed, k_cache, v_cache, start: int, in_norm, qkv_w, qkv_b, o_w, post_norm, gu_w, down_w):
        q, k, v = project(x, cos, sin, in_norm, qkv_w, qkv_b)
        end = start + x.size(1)
        k_cache[:, :, start:end] = k
        v_cache[:, :, start:end] = v
        return attend(x, q, k_cache[:, :, :end], v_cache[:, :, :end], allowed, o_w, post_norm, gu_w, down_w)

    return layer


def prefill_math(w: list[torch.Tensor], inv_freq, ids, mask, arch: Arch, rope_scale: float, layer=None):
    """Prompt forward for left-padded ``ids`` (B, W): last-position logits and K/V of shape (L, B, kv, W, d)."""
    layer = layer or make_prefill_layer(arch)
    width = ids.shape[1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    x = F.embedding(ids, w[-2])
    cos, sin = _rope_tables(inv_freq, rope_scale, positions, x.dtype)
    causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
    # a padding query sees itself, so no row of the softmax is empty (and no NaN reaches the cache)
    allowed = (causal[None] & mask.bool()[:, None, :]) | torch.eye(width, dtype=torch.bool, device=ids.device)[None]
    ks, vs = [], []
    for i in range(arch.layers):
        x, k, v = layer(x, cos[:, None], sin[:, None], allowed[:, None], *w[7 * i : 7 * i + 7])
        ks.append(k)
        vs.append(v)
    logits = F.linear(_rms_norm(x[:, -1], w[-3], arch.eps), w[-1])
    return logits, torch.stack(ks), torch.stack(vs)


def extend_math(
    w: list[torch.Tensor],
    inv_freq,
    ids,
    positions,
    allowed,
    k_cache,
    v_cache,
    start: int,
    arch: Arch,
    rope_scale: float,
    layer,
) -> torch.Tensor:
    """Forward of left-padded new prompt tokens ``ids`` (B, W) over cached K/V: last-position logits.

    ``positions``: (B, W) RoPE positions (the cached prefix's length onwards); ``allowed``: (B, W,
    start + W) the cache columns each query sees; ``k_cache``/``v_cache``: (L, B, kv, S, d) views
    whose columns ``[start, start + W)`` receive the new tokens' K/V (``layer``: ``make_extend_layer``).
    """
    x = F.embedding(ids, w[-2])
    cos, sin = _rope_tables(inv_freq, rope_scale, positions, x.dtype)
    for i in range(arch.layers):
        x = layer(
            x, cos[:, None], sin[:, None], allowed[:, None], k_cache[i], v_cache[i], start, *w[7 * i : 7 * i + 7]
        )
    return F.linear(_rms_norm(x[:, -1], w[-3], arch.eps), w[-1])
