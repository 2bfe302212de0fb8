"""Decode-step attention over the static KV cache as one Triton kernel (split-KV, GQA-aware).

One new token per row attends to the cache columns ``[pad_start, col)`` plus itself, minus an optional
per-row hole ``[hole_lo, hole_hi)`` (a reused prompt prefix, then stale columns, then the new turn's
prompt: the fast engine's prefix reuse, ``generator``). The kernel also writes the token's K/V into
column ``col``, so a layer's attention is one launch where the cuDNN form needed a cache write (two
``index_copy``), a mask conversion and the fused kernel, and it reads only the columns in use (the
cuDNN form reads the whole 256-rounded bucket).

Work is split over ``(row, kv head, split)`` programs: at batch 32 there are only 64 (row, head)
pairs for 132 SMs, so each pair's columns are cut into ``splits`` chunks whose partial softmax
results (running max, sum, weighted values) go to memory; the program that finishes a (row, head)
last (an atomic counter) merges them, so no second kernel runs. The ``g`` query heads sharing a
KV head are the rows of one small matrix product, so no K/V is repeated.

Only the GPU runs it; the tests run it under Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``), against the plain softmax attention.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the engine then uses its torch attention forms
    triton = None

BLOCK_N = 64  # cache columns per inner iteration
PROGRAMS_PER_SM = 2  # H200, batch 32, 768-1024 columns: 2.15 ms a step at 2, 2.16 at 4, 2.24 at 8, 2.13 at 1 (per SM)


def available(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``: a GPU, or any device under Triton's interpreter (tests)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def supports(head_dim: int, group: int) -> bool:
    """Shapes the kernel handles: a power-of-two head dim of 16 or more, up to 64 query heads a KV head."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and group <= 64


def split_count(rows: int, kv_heads: int, columns: int, sms: int) -> int:
    """Chunks each (row, head)'s columns are cut into: enough programs to fill ``sms`` a few times over."""
    pairs = rows * kv_heads
    want = -(-PROGRAMS_PER_SM * sms // pairs)
    return max(1, min(want, -(-columns // BLOCK_N)))


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(device, n_rows: int, kv_heads: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (row, head): splits finished, set back to 0 by the merging one.

    Kept for the life of the process: CUDA graphs hold their address.
    """
    key = (str(device), n_rows, kv_heads)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n_rows * kv_heads, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _no_hole(device, n_rows: int) -> torch.Tensor:
    """An empty hole ``[0, 0)`` per row, kept like the counters (CUDA graphs hold its address)."""
    key = (str(device), n_rows, "hole")
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n_rows, 2, dtype=torch.long, device=device)
    return _COUNTERS[key]


if triton is not None:

    @triton.jit
    def _attend_columns(
        q, kc, vc, s_cs, lo, hi, m_i, l_i, acc, scale, D: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr
    ):
        """The online softmax over cache columns ``[lo, hi)``, folded into ``(m_i, l_i, acc)``."""
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK)
        for start in range(lo, hi, BLOCK):
            cols = start + n
            ok = cols < hi
            k = tl.load(kc + cols[:, None] * s_cs + d[None, :], mask=ok[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: every block holds a valid column
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            v = tl.load(vc + cols[:, None] * s_cs + d[None, :], mask=ok[:, None], other=0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _rotated(ptr, offs, d, cs, sn, D: tl.constexpr, mask):
        """Rows of head vectors at ``ptr + offs + d`` turned by RoPE: ``x·cos + rotate_half(x)·sin``, in fp32."""
        x = tl.load(ptr + offs + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + offs + (d + D // 2) % D, mask=mask, other=0.0).to(tl.float32)
        return x * cs + tl.where(d < D // 2, -x2, x2) * sn

    @triton.jit
    def _decode_attention_kernel(
        q_ptr,
        kn_ptr,
        vn_ptr,
        kc_ptr,
        vc_ptr,
        pad_ptr,
        hole_ptr,
        col_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        acc_ptr,
        ml_ptr,
        cnt_ptr,
        s_qb,
        s_qh,
        s_qg,
        s_nb,
        s_nh,
        s_vb,
        s_vh,
        s_cb,
        s_ch,
        s_cs,
        s_ob,
        s_oh,
        s_ab,
        s_ah,
        s_as,
        s_mb,
        s_mh,
        s_ms,
        chunk,
        scale,
        KV,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        PREC: tl.constexpr,
        SPLITS: tl.constexpr,
        ROPE: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        col = tl.load(col_ptr)
        lo = tl.maximum(tl.load(pad_ptr + b), s * chunk)
        hi = tl.minimum(s * chunk + chunk, col)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        rows = g[:, None] < G
        if ROPE:  # q and the token's k arrive unrotated: turned here, rounded once to their dtype
            cs = tl.load(cos_ptr + b * D + d).to(tl.float32)
            sn = tl.load(sin_ptr + b * D + d).to(tl.float32)
            q = _rotated(q_ptr, b * s_qb + h * s_qh + g[:, None] * s_qg, d[None, :], cs[None, :], sn[None, :], D, rows)
            q = q.to(q_ptr.dtype.element_ty)
        else:
            q = tl.load(q_ptr + b * s_qb + h * s_qh + g[:, None] * s_qg + d[None, :], mask=rows, other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        kc = kc_ptr + b * s_cb + h * s_ch
        vc = vc_ptr + b * s_cb + h * s_ch
        # the columns before the row's hole, then those after it (an empty hole is [0, 0))
        hole_lo = tl.load(hole_ptr + 2 * b)
        hole_hi = tl.load(hole_ptr + 2 * b + 1)
        m_i, l_i, acc = _attend_columns(
            q, kc, vc, s_cs, lo, tl.minimum(hi, hole_lo), m_i, l_i, acc, scale, D, BLOCK, PREC
        )
        m_i, l_i, acc = _attend_columns(
            q, kc, vc, s_cs, tl.maximum(lo, hole_hi), hi, m_i, l_i, acc, scale, D, BLOCK, PREC
        )
        if s == 0:  # the token itself, from the new K/V (no program reads column ``col`` from the cache)
            if ROPE:
                kn = _rotated(kn_ptr, b * s_nb + h * s_nh, d, cs, sn, D, d < D).to(kn_ptr.dtype.element_ty)
            else:
                kn = tl.load(kn_ptr + b * s_nb + h * s_nh + d)
            vn = tl.load(vn_ptr + b * s_vb + h * s_vh + d)
            own = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale
            m_new = tl.maximum(m_i, own)
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(own - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * vn.to(tl.float32)[None, :]
            m_i = m_new
            tl.store(kc + col * s_cs + d, kn)
            tl.store(vc + col * s_cs + d, vn)
        out = out_ptr + b * s_ob + h * s_oh + g[:, None] * D + d[None, :]
        if SPLITS == 1:
            tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=rows)
        else:
            # Partial results to memory; the split that finishes last (the counter's atomic add is
            # acq_rel, so the others' stores are visible) merges them. Its loads skip L1 (.cg).
            part = acc_ptr + b * s_ab + h * s_ah + g[:, None] * D + d[None, :]
            ml = ml_ptr + b * s_mb + h * s_mh + g
            tl.store(part + s * s_as, acc, mask=rows)
            tl.store(ml + s * s_ms, m_i, mask=g < G)
            tl.store(ml + s * s_ms + G, l_i, mask=g < G)
            if tl.atomic_add(cnt_ptr + b * KV + h, 1) == SPLITS - 1:
                top = tl.full([GP], float("-inf"), tl.float32)
                for i in tl.static_range(SPLITS):
                    top = tl.maximum(top, tl.load(ml + i * s_ms, mask=g < G, other=0.0, cache_modifier=".cg"))
                num = tl.zeros([GP, D], tl.float32)
                den = tl.zeros([GP], tl.float32)
                for i in tl.static_range(SPLITS):  # a split with no columns has m = -inf: weight 0
                    w = tl.exp(tl.load(ml + i * s_ms, mask=g < G, other=0.0, cache_modifier=".cg") - top)
                    den += w * tl.load(ml + i * s_ms + G, mask=g < G, other=0.0, cache_modifier=".cg")
                    num += w[:, None] * tl.load(part + i * s_as, mask=rows, other=0.0, cache_modifier=".cg")
                tl.store(out, (num / den[:, None]).to(out_ptr.dtype.element_ty), mask=rows)
                tl.atomic_xchg(cnt_ptr + b * KV + h, 0)  # ready for the next launch


def decode_attention(
    q,
    k_new,
    v_new,
    k_cache,
    v_cache,
    pad_start,
    col,
    scale: float,
    splits: int,
    hole=None,
    cos=None,
    sin=None,
    counters=None,
) -> torch.Tensor:
    """Attention of one new token per row over its cache columns and itself: (B, kv, g, d), ``q``'s dtype.

    ``q``: (B, kv, g, d); ``k_new``/``v_new``: (B, kv, d), written into column ``col`` (a (1,)
    long tensor) of ``k_cache``/``v_cache`` (B, kv, S, d, last dim contiguous); ``pad_start``:
    (B,) each row's first real column; ``splits``: chunks the columns are cut into (``split_count``);
    ``hole``: (B, 2) long, each row's columns ``[lo, hi)`` to skip (``None``: no hole); ``cos``/``sin``:
    (B, d) RoPE tables to turn ``q`` and ``k_new`` by first (``None``: they arrive turned). The cache
    receives the turned ``k_new``. ``counters``: zeroed int32, one per (row, KV head), that the splits
    count on and leave zeroed (``None``: the process's shared ones; two launches that may run at once,
    on two streams, need their own).
    """
    n_rows, kv_heads, g, d = q.shape
    columns = k_cache.size(2)
    if any(t.stride(-1) != 1 for t in (q, k_new, v_new, k_cache)) or k_cache.stride() != v_cache.stride():
        raise ValueError("decode_attention needs the head dimension contiguous and K/V caches of one layout")
    per_split = -(-columns // splits)
    chunk = -(-per_split // BLOCK_N) * BLOCK_N  # whole blocks of columns per split
    splits = -(-columns // chunk)
    out = torch.empty(n_rows, kv_heads, g, d, dtype=q.dtype, device=q.device)
    kept = splits if splits > 1 else 0  # one split writes ``out`` directly
    acc = torch.empty(n_rows, kv_heads, kept, g, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(n_rows, kv_heads, kept, 2, g, dtype=torch.float32, device=q.device)
    if hole is None:
        hole = _no_hole(q.device, n_rows)
    rope = cos is not None
    if rope and (
        cos.shape != (n_rows, d) or sin.shape != (n_rows, d) or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        raise ValueError("decode_attention's cos/sin are contiguous (rows, head dim) tables")
    if hole.shape != (n_rows, 2) or not hole.is_contiguous():
        raise ValueError("decode_attention's hole is a contiguous (rows, 2) tensor of [lo, hi) columns")
    if counters is None:
        counters = _counters(q.device, n_rows, kv_heads)
    elif counters.dtype != torch.int32 or counters.numel() < n_rows * kv_heads:
        raise ValueError("decode_attention's counters are int32, one per (row, KV head)")
    _decode_attention_kernel[(n_rows, kv_heads, splits)](
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        pad_start,
        hole,
        col,
        cos if rope else q,
        sin if rope else q,
        out,
        acc,
        ml,
        counters,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        ml.stride(0),
        ml.stride(1),
        ml.stride(2),
        chunk,
        scale,
        kv_heads,
        G=g,
        GP=max(16, triton.next_power_of_2(g)),
        D=d,
        BLOCK=BLOCK_N,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 (the guard) stays fp32, not TF32
        SPLITS=splits,
        ROPE=rope,
    )
    return out


def reference(
    q, k_new, v_new, k_cache, v_cache, pad_start, col: int, scale: float, hole=None, cos=None, sin=None
) -> torch.Tensor:
    """The same attention in plain torch (fp32): the tests' yardstick."""
    n_rows, kv_heads, g, d = q.shape
    if cos is not None:

        def turn(x, c, s):
            return x * c + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * s

        q = turn(q.float(), cos.float()[:, None, None], sin.float()[:, None, None])
        k_new = turn(k_new.float(), cos.float()[:, None], sin.float()[:, None])
    k = k_cache.float().clone()
    v = v_cache.float().clone()
    k[:, :, col] = k_new.float()
    v[:, :, col] = v_new.float()
    cols = torch.arange(k.size(2))
    seen = (cols[None, :] >= pad_start[:, None]) & (cols[None, :] <= col)  # (B, S)
    if hole is not None:
        seen &= (cols[None, :] < hole[:, :1]) | (cols[None, :] >= hole[:, 1:])
    sc = torch.einsum("bhgd,bhsd->bhgs", q.float(), k) * scale
    sc = sc.masked_fill(~seen[:, None, None, :], float("-inf"))
    return torch.einsum("bhgs,bhsd->bhgd", torch.softmax(sc, -1), v)
