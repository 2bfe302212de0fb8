"""The fast rollout engine: merged weights, a static KV cache, one CUDA graph per decode step.

What makes it fast (DESIGN §4), in the order it matters on a GPU:

* **Merged weights.** Seat turns run on an inference copy of the weights with the LoRA product
  folded in (``W + s·B·A``, q/k/v and gate/up fused into one matrix each). ``sync_weights`` rewrites
  that copy in place after every optimizer step, so captured graphs see the new policy. Base-seat
  turns (mixed partners, base evals) run on a second fused copy without the adapter; PEFT's
  per-row adapter routing and ``disable_adapter`` are never on the hot path.
* **Static KV cache, one CUDA graph per step.** The cache is allocated once per batch size; a
  decode step (embed → 28 layers → sampling → cache write → stop flags) is captured as one CUDA
  graph, so a step is one ``replay()`` with no host work. One layer function is ``torch.compile``'d
  and serves all 28 layers (seconds to compile, not minutes). Attention reads only the first ``S``
  columns of the cache, ``S`` the turn's prompt width plus ``max_new_tokens`` rounded up to 256, so
  short turns do not pay for the longest one. Its form (``attention="auto"``): on a GPU one Triton
  split-KV kernel that also writes the token's K/V and reads only the columns in use
  (``decode_attention``; on an H200 2.35 against 2.81 ms a step at batch 32 for cuDNN's fused SDPA,
  8.9 against 11.7 ms at batch 600); elsewhere one fused SDPA kernel up to batch 256, two products above.
* **Both weight sets at once.** A call with adapter and base rows (mixed partners' B turns) runs
  one batch per set, decoded together: each replays its graph on its own stream (its own cache,
  split counters, graph pool and capture stream), so at a few rows their kernels overlap (H200:
  a 16 + 16-row turn 0.79 s against 1.05 s one after the other).
* **Sampling on the device** from uniforms drawn once per turn (inverse CDF, top-k before top-p,
  the same rule as ``engine.pick_token``, searched in 128-token blocks so no full-vocabulary scan
  or sort runs), and the per-token log-prob of every sampled token under ``softmax(logits / T)``:
  the trainer compares it with its own (``train_log.jsonl``: ``logp_diff_max``). Plain sampling
  (the training rollouts: temperature only) is two Triton kernels on a GPU (``decode_sampling``).

On a CPU (tests, the offline default) the same maths runs eagerly, without compile or graphs.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from talkmethods import decode_attention as da
from talkmethods import decode_sampling as ds
from talkmethods.engine import sample_with_logprob
from talkmethods.rollout import PlainGenerator, Sampling, refuse_repetition_penalty

log = logging.getLogger(__name__)

ADAPTER = "default"
COLUMN_BUCKET = 256  # cache columns attended are rounded up to this (one graph per bucket)
AUTO_SDPA_ROWS = 256  # attention="auto": the fused kernel up to this batch, the two products above
PREFILL_TOKENS = 32_768  # prompt tokens per prefill chunk (bounds activation memory)


def batch_bucket(n: int) -> int:
    """Rows a batch of ``n`` chats is padded to: powers of two up to 512, then multiples of 128."""
    if n <= 512:
        return max(8, 1 << (n - 1).bit_length())
    return -(-n // 128) * 128


@dataclass(frozen=True)
class Arch:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def of(cls, config) -> "Arch":
        if getattr(config, "model_type", None) not in ("qwen2",):
            raise ValueError(f"the fast engine runs Qwen2-architecture models, not {config.model_type!r}: set train.engine and eval.engine to loop")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   config.rms_norm_eps)


def _base_model(model):
    """The HF CausalLM under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _effective_weight(linear, adapter: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (weight, bias) a possibly-LoRA Linear applies, the adapter folded in when ``adapter``."""
    if not hasattr(linear, "base_layer"):
        return linear.weight, linear.bias
    base = linear.base_layer
    weight = base.weight
    if adapter and ADAPTER in linear.lora_A:
        if linear.use_dora.get(ADAPTER, False):
            raise ValueError("the fast engine does not merge DoRA adapters: set train.engine and eval.engine to loop")
        a = linear.lora_A[ADAPTER].weight.float()
        b = linear.lora_B[ADAPTER].weight.float()
        weight = (weight.float() + (b @ a) * linear.scaling[ADAPTER]).to(weight.dtype)
    return weight, base.bias


class FusedWeights:
    """One fused inference copy of the policy's weights, with or without the adapter.

    Per layer: ``[in_norm, qkv_w, qkv_b, o_w, post_norm, gate_up_w, down_w]``; then ``[norm, embed, lm_head]``.
    Norms and embeddings are the model's own tensors (LoRA does not touch them); the fused matrices are
    owned here and rewritten in place by ``refresh`` so that captured CUDA graphs keep their addresses.
    """

    def __init__(self, model, adapter: bool):
        self.model, self.adapter = model, adapter
        hf = _base_model(model)
        self.arch = Arch.of(hf.config)
        self.tensors: list[torch.Tensor] = []
        with torch.no_grad():
            for layer in hf.model.layers:
                att, mlp = layer.self_attn, layer.mlp
                qkv_w, qkv_b = self._cat([att.q_proj, att.k_proj, att.v_proj])
                gu_w, _ = self._cat([mlp.gate_proj, mlp.up_proj])
                self.tensors += [layer.input_layernorm.weight, qkv_w, qkv_b,
                                 _effective_weight(att.o_proj, adapter)[0].clone(),
                                 layer.post_attention_layernorm.weight, gu_w,
                                 _effective_weight(mlp.down_proj, adapter)[0].clone()]
            self.tensors += [hf.model.norm.weight, hf.model.embed_tokens.weight, hf.lm_head.weight]
        rope = hf.model.rotary_emb
        self.inv_freq = rope.inv_freq.float().clone()
        self.rope_scale = float(getattr(rope, "attention_scaling", 1.0))

    def _cat(self, linears) -> tuple[torch.Tensor, torch.Tensor]:
        ws, bs = zip(*(_effective_weight(lin, self.adapter) for lin in linears), strict=True)
        w = torch.cat(ws, 0)
        b = torch.cat([bb if bb is not None else torch.zeros(ww.size(0), dtype=ww.dtype, device=ww.device)
                       for ww, bb in zip(ws, bs, strict=True)])
        return w, b

    @torch.no_grad()
    def refresh(self) -> None:
        """Rewrite the fused matrices from the model's current weights (in place)."""
        hf = _base_model(self.model)
        for i, layer in enumerate(hf.model.layers):
            att, mlp = layer.self_attn, layer.mlp
            t = self.tensors[7 * i : 7 * i + 7]
            w, b = self._cat([att.q_proj, att.k_proj, att.v_proj])
            t[1].copy_(w)
            t[2].copy_(b)
            t[3].copy_(_effective_weight(att.o_proj, self.adapter)[0])
            t[5].copy_(self._cat([mlp.gate_proj, mlp.up_proj])[0])
            t[6].copy_(_effective_weight(mlp.down_proj, self.adapter)[0])


# ---------------------------------------------------------------------------------------------
# The model maths (pure functions of tensors: compiled and graphed on a GPU, eager on a CPU).


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm, rounding where transformers rounds."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope_tables(inv_freq, scale, positions, dtype):
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _qkv(x, in_norm, qkv_w, qkv_b, arch: Arch):
    """The attention block's normed input projected to q, k and v (one fused matmul)."""
    d = arch.head_dim
    qkv = F.linear(_rms_norm(x, in_norm, arch.eps), qkv_w, qkv_b)
    return qkv.split([arch.heads * d, arch.kv_heads * d, arch.kv_heads * d], dim=-1)


def _mlp_residual(x, post_norm, gu_w, down_w, eps: float):
    """``x`` plus Qwen2's SwiGLU MLP of its norm (gate and up in one fused matmul)."""
    gate, up = F.linear(_rms_norm(x, post_norm, eps), gu_w).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w)


def _rotate(x, cos, sin):
    half = x.size(-1) // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


ATTENTION_FORMS = ("matmul", "vt", "reduce", "sdpa", "triton")


def make_layer_step(arch: Arch, attention: str = "matmul", compile_fn=None, sms: int = 132):
    """``_layer_step``'s layer; with ``compile_fn`` it also carries the step's two ends compiled (``ends``).

    The ends (embedding and RoPE tables; the final norm and the LM head) are ~20 small launches a
    step when eager; compiled, a few.
    """
    layer_step = _layer_step(arch, attention, compile_fn, sms)
    if compile_fn is not None and COMPILE_ENDS:
        layer_step.ends = (compile_fn(step_start), compile_fn(head_logits))
    return layer_step


COMPILE_ENDS = True  # False: the ends run eagerly beside a compiled layer (the A/B of docs/speed_h200.md)


def _layer_step(arch: Arch, attention: str, compile_fn, sms: int):
    """One transformer layer for one new token per row; ``compile_fn`` (``torch.compile`` on a GPU) wraps its maths.

    ``x``: (B, H) hidden states; ``cos``/``sin``: (B, 1, d); ``blocked``: (B, 1, 1, S) cache columns a
    row may not see; ``col``: (1,) the token's cache column; ``k_cache``/``v_cache``: (B, kv, S, d)
    views. Returns the new ``x`` and the token's K/V (B, kv, d), which the caller writes into the cache.

    Forms of the attention over the cache: ``matmul``/``vt``/``reduce`` read the cache without the
    new token and add its own score beside (no mutation inside the compiled code, which would copy
    the cache); ``sdpa`` writes the token's K/V first and runs one fused attention kernel over the
    cache, so the layer is two compiled pieces around the write; ``triton`` (GPU only) is one split-KV
    kernel that writes the token's K/V and attends to the columns in use (``decode_attention``), between
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
        x = x + F.linear(att.reshape(x.size(0), heads * d), o_w)
        return _mlp_residual(x, post_norm, gu_w, down_w, eps)

    if attention == "sdpa":
        def attend(x, q, allowed, k_cache, v_cache, o_w, post_norm, gu_w, down_w):
            att = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=allowed, scale=scale)
            return finish(x, att, o_w, post_norm, gu_w, down_w)

        project_c, attend_c = wrap(project), wrap(attend)

        def layer_step(x, cos, sin, allowed, col, k_cache, v_cache, in_norm, qkv_w, qkv_b, o_w, post_norm, gu_w, down_w):
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
            x = (x.float() + F.linear(att.reshape(x.size(0), heads * d), o_w).float()).to(x.dtype)  # = the bf16 add
            gate, up = F.linear(_rms_norm(x, post_norm, eps), gu_w).chunk(2, dim=-1)
            return x, F.linear(F.silu(gate) * up, down_w)

        project_c, finish_c = wrap(project_raw), wrap(finish_apart)

        def layer_step(carry, cos, sin, bounds, col, k_cache, v_cache, in_norm, qkv_w, qkv_b, o_w, post_norm, gu_w, down_w):
            x, q, k, v = project_c(*carry, in_norm, qkv_w, qkv_b)
            splits = da.split_count(x.size(0), kv_heads, k_cache.size(2), sms)
            pad_start, hole, counters = bounds
            att = da.decode_attention(q, k, v, k_cache, v_cache, pad_start, col, scale, splits, hole, cos, sin, counters)
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
        if attention == "vt":  # the same product transposed: cuBLAS picks another kernel for (d, S) @ (S, g)
            past_v = torch.matmul(v_cache.transpose(-1, -2), p[..., :-1].transpose(-1, -2)).transpose(-1, -2)
        elif attention == "reduce":  # a fused multiply-and-sum over the cache columns
            past_v = (p[..., :-1, None].float() * v_cache[:, :, None].float()).sum(-2).to(x.dtype)
        else:
            past_v = torch.matmul(p[..., :-1], v_cache)
        att = past_v + p[..., -1:] * v[:, :, None, :]
        return finish(x, att, o_w, post_norm, gu_w, down_w), k, v

    layer_step = wrap(fused)
    return layer_step


def _visible(cols, pad_start, hole_lo, hole_hi, end):
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


def sample(logits, u, sampling: Sampling):
    """``engine.sample_with_logprob``; plain sampling on a GPU through the two-kernel sampler (``decode_sampling``)."""
    if ds.handles(logits.device, sampling.top_k, sampling.top_p, logits.size(-1)):
        return ds.sample_with_logprob(logits, sampling.temperature, u)
    return sample_with_logprob(logits, sampling.temperature, sampling.top_k, sampling.top_p, u)


def decode_math(layer_step, w: list[torch.Tensor], inv_freq, rope_scale: float, eps: float, tok, pos, col,
                pad_start, hole, u, k_cache, v_cache, sampling: Sampling, counters=None):
    """One decode step for every row: the new token's K/V, the next token and its log-prob.

    ``tok``/``pos``/``pad_start``/``u``: (B,) current token, its RoPE position, the row's first real
    cache column, a uniform; ``hole``: (B, 2) cache columns ``[lo, hi)`` a row skips (a reused prefix's
    stale tail, see ``FastGenerator``; ``[0, 0)`` when none); ``col``: (1,) the cache column ``tok`` belongs to; ``k_cache``/``v_cache``:
    (L, B, kv, S, d) views (columns ``>= col`` are ignored; the ``sdpa`` form writes column ``col``);
    ``counters``: the batch's own split counters for the ``triton`` form (``decode_attention``).
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
        seen = _visible(cols[None, :], pad_start[:, None], hole[:, :1], hole[:, 1:], col + 1 if own else col)[:, None, None, :]
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
        att = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=allowed)
        x = x + F.linear(att.transpose(1, 2).reshape(n_rows, width, heads * d), o_w)
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


def extend_math(w: list[torch.Tensor], inv_freq, ids, positions, allowed, k_cache, v_cache, start: int, arch: Arch,
                rope_scale: float, layer) -> torch.Tensor:
    """Forward of left-padded new prompt tokens ``ids`` (B, W) over cached K/V: last-position logits.

    ``positions``: (B, W) RoPE positions (the cached prefix's length onwards); ``allowed``: (B, W,
    start + W) the cache columns each query sees; ``k_cache``/``v_cache``: (L, B, kv, S, d) views
    whose columns ``[start, start + W)`` receive the new tokens' K/V (``layer``: ``make_extend_layer``).
    """
    x = F.embedding(ids, w[-2])
    cos, sin = _rope_tables(inv_freq, rope_scale, positions, x.dtype)
    for i in range(arch.layers):
        x = layer(x, cos[:, None], sin[:, None], allowed[:, None], k_cache[i], v_cache[i], start, *w[7 * i : 7 * i + 7])
    return F.linear(_rms_norm(x[:, -1], w[-3], arch.eps), w[-1])


# ---------------------------------------------------------------------------------------------


class _Slots:
    """Static buffers of one batch size: the KV cache and the decode state a graph reads and writes."""

    def __init__(self, arch: Arch, rows: int, columns: int, steps: int, dtype, device):
        shape = (arch.layers, rows, arch.kv_heads, columns, arch.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # zeros: masked columns must be finite
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.columns, self.steps = columns, steps
        z = dict(dtype=torch.long, device=device)
        self.tok, self.pos, self.pad_start = (torch.zeros(rows, **z) for _ in range(3))
        self.hole = torch.zeros(rows, 2, **z)  # columns [lo, hi) a row skips: a reused prefix's stale tail
        self.col, self.step = torch.zeros(1, **z), torch.zeros(1, **z)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.u = torch.zeros(steps, rows, device=device)
        self.out_tok = torch.zeros(rows, steps, **z)
        self.out_logp = torch.zeros(rows, steps, device=device)
        # the attention kernel's split counters: a batch's own, so two batches may decode concurrently
        self.counters = torch.zeros(rows * arch.kv_heads, dtype=torch.int32, device=device)


@dataclass
class _Lane:
    """What a lane's last turn left in its cache, for the lane's next turn to continue.

    Row ``i``'s tokens ``tokens[i]`` (its prompt and all of its completion but the last token) have
    their K/V in columns ``[starts[i], starts[i] + len(tokens[i]))``; columns up to ``end`` were written.
    """

    n: int
    starts: list[int]
    tokens: list[list[int]]
    end: int


@dataclass(eq=False)  # a batch is itself: ``_decode`` drops finished ones from a list by identity
class _Batch:
    """One batch on one weight set between ``_begin`` and ``_finish``: ``t`` tokens sampled so far."""

    prompts: list
    weights: "FusedWeights"
    sampling: Sampling
    lane: tuple | None
    slots: _Slots
    graph: object
    columns: int
    state: "_Lane | None"
    end: int  # the first column the decode writes (after the prompts)
    t: int = 1


class FastGenerator(PlainGenerator):
    """Rollout engine over fused merged weights and a static KV cache (CUDA graphs on a GPU).

    Same interface as ``PlainGenerator``; also returns per-token log-probs in ``last_logprobs``.
    A trainer calls ``sync_weights()`` after each optimizer step; an eval builds it once.
    """

    def __init__(self, model, tokenizer, graphs: bool | None = None, compile: bool | None = None,
                 attention: str = "auto"):
        super().__init__(model, tokenizer)
        device = next(model.parameters()).device
        self.device = device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        compile = self.graphs if compile is None else compile
        self.is_peft = hasattr(model, "disable_adapter")
        self.weights = {False: FusedWeights(model, adapter=False)}
        if self.is_peft:
            self.weights[True] = FusedWeights(model, adapter=True)
        self.arch = self.weights[False].arch
        self.dtype = self.weights[False].tensors[1].dtype
        self._slots: dict[tuple, _Slots] = {}  # (rows, lane): a lane keeps its own cache
        self._lanes: dict[tuple, _Lane] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pools: dict[bool, object] = {}  # a graph memory pool per weight set: their batches may run at once
        self._streams: list = []
        self._capture_streams: dict[bool, object] = {}
        # The layer is compiled once for all 28 layers (seconds, not minutes), and the step's two ends
        # beside it; shapes become symbolic after the second batch/column size. Sampling is not
        # compiled: plain sampling runs as two Triton kernels (decode_sampling), top-k/top-p in torch.
        if attention != "auto" and attention not in ATTENTION_FORMS:
            raise ValueError(f"unknown attention form {attention!r}; auto or one of {ATTENTION_FORMS}")
        self.attention = attention
        self._wrap = (lambda f: torch.compile(f, fullgraph=True)) if compile else None
        self._layers: dict[str, object] = {}
        dynamic = (lambda f: torch.compile(f, fullgraph=True, dynamic=True)) if compile else None
        self._prefill_layer = make_prefill_layer(self.arch, dynamic)
        self._extend_layer = make_extend_layer(self.arch, dynamic)
        self.eos = torch.tensor(self.eos_ids, device=device)
        self.captures = 0
        # wall-clock split of the work done so far (synchronised at batch edges only)
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "row_steps": 0, "capture_s": 0.0,
                       "prompt_tokens": 0, "reused_tokens": 0}
        if compile:
            from torch import _dynamo

            # one compile per new batch/column shape until dynamo makes them symbolic; sampling settings add a few
            name = "recompile_limit" if hasattr(_dynamo.config, "recompile_limit") else "cache_size_limit"
            setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), 64))

    def _layer_for(self, rows: int):
        """The decode layer for a batch of ``rows``: ``auto`` takes the form measured fastest there.

        On a GPU that is the Triton kernel (``triton``), the fastest at batch 32 and 600 on an H200
        (docs/speed_h200.md); elsewhere one fused attention kernel (``sdpa``) up to ``AUTO_SDPA_ROWS``
        rows and the two products (``matmul``) above, as measured there before the kernel.
        """
        form = self.attention if self.attention != "auto" else self._auto_form(rows)
        if form == "triton" and not da.available(self.device):
            raise ValueError("attention='triton' needs a CUDA device and the triton package")
        if form not in self._layers:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 132
            self._layers[form] = make_layer_step(self.arch, form, self._wrap, sms)
        return self._layers[form]

    def _auto_form(self, rows: int) -> str:
        if da.available(self.device) and da.supports(self.arch.head_dim, self.arch.heads // self.arch.kv_heads):
            return "triton"
        return "sdpa" if rows <= AUTO_SDPA_ROWS else "matmul"

    reuses_turns = True  # ``play_chats`` names each seat's lane (``generate(..., lane=seat)``)

    def sync_weights(self) -> None:
        """Fold the adapter's current weights into the inference copy (after each optimizer step)."""
        if self.is_peft:
            self.weights[True].refresh()
        self._lanes.clear()  # cached K/V of the old weights are not continued

    def generate(self, prompts: list[list[int]], adapter_on: list[bool], sampling: Sampling,
                 lane: str | None = None) -> list[list[int]]:
        """Sample a completion per prompt (``PlainGenerator.generate``), keeping K/V per ``lane``.

        A lane is a sequence of turns over the same rows (``play_chats``: a seat). A prompt that starts
        with what its row left in the lane's cache last turn (that prompt and its completion, the
        seat's own words as sampled) has only the rest prefilled: a seat's second turn prefills the
        partner's reply, not the whole dialogue. Other rows (and every row after new weights) are
        prefilled whole. A lane continues once, then starts afresh.
        """
        if not self.is_peft and any(adapter_on):
            raise ValueError("adapter requested but the model has no adapter")
        refuse_repetition_penalty(sampling, "fast")
        outs: list = [None] * len(prompts)
        logps: list = [None] * len(prompts)
        # one batch per weight set (base-seat rows run on the base copy); with both, the two decode
        # together: step by step, on two CUDA streams when graphs run
        sets = [(on, [i for i, a in enumerate(adapter_on) if a == on]) for on in (True, False)]
        sets = [(on, rows) for on, rows in sets if rows]
        with torch.no_grad():
            batches = [self._begin([prompts[i] for i in rows], self.weights[on], sampling,
                                   None if lane is None else (lane, on)) for on, rows in sets]
            self._decode(batches)
            for (_, rows), batch in zip(sets, batches, strict=True):
                toks, lps = self._finish(batch)
                for i, t, lp in zip(rows, toks, lps, strict=True):
                    outs[i], logps[i] = t, lp
        self.last_logprobs = logps
        return outs

    # -- one batch on one weight set ------------------------------------------------------------

    def _begin(self, prompts, weights: FusedWeights, sampling: Sampling, lane: tuple | None = None) -> "_Batch":
        """Set a batch up: its cache and graph, its prompts prefilled, its first token sampled."""
        n, steps = len(prompts), sampling.max_new_tokens
        rows = batch_bucket(n) if self.graphs else n
        reused = self._continues(self._lanes.pop(lane, None) if lane is not None else None, prompts)
        if reused is None:  # the whole prompts, from column 0
            state, fed, base = None, prompts, 0
        else:  # the rest of each prompt, after the columns the lane's last turn wrote
            state, cached = reused
            fed, base = [p[c:] for p, c in zip(prompts, cached, strict=True)], state.end
        width = max(len(p) for p in fed)
        columns = -(-(base + width + steps) // COLUMN_BUCKET) * COLUMN_BUCKET
        # a lane's first turn leaves room for its next: this turn, the partner's reply, one more turn
        need = base + width + 3 * steps + 64 if lane is not None and state is None else columns
        # a batch's buffers: its lane's, or (no lane) its weight set's, so both sets' batches can run at once
        own = lane if lane is not None else (None, weights.adapter)
        slots = self._slots_for(rows, max(columns, need), steps, own)
        t0 = time.perf_counter()
        graph = self._graph_for(slots, rows, columns, weights, sampling, own) if self.graphs else None
        self.timing["capture_s"] += time.perf_counter() - t0

        padded = fed + [[self.pad_id]] * (rows - n)  # bucket rows: finished from the start
        ids, mask = self.left_pad(padded)
        fed_len = mask.sum(-1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        first = base + width - fed_len  # each row's first fed column
        if state is None:
            slots.pad_start.copy_(first)
            slots.hole.zero_()
            slots.pos.copy_(fed_len)
        else:
            c = torch.tensor(cached + [0] * (rows - n), device=self.device)
            start = torch.tensor(state.starts + [0] * (rows - n), device=self.device)
            keep = c > 0  # rows continuing their cached prefix: skip the stale columns between
            slots.pad_start.copy_(torch.where(keep, start, first))
            slots.hole.copy_(torch.stack([torch.where(keep, start + c, 0), torch.where(keep, first, 0)], 1))
            slots.pos.copy_(c + fed_len)
            positions = positions + c[:, None]
        slots.col.fill_(base + width)
        slots.step.zero_()
        slots.done.copy_(torch.arange(rows, device=self.device) >= n)
        slots.out_tok.fill_(self.pad_id)
        slots.out_logp.zero_()
        slots.u[:steps].uniform_()  # the global (seeded) RNG: reproducible rollouts

        t0 = time.perf_counter()
        if state is None:
            logits = self._prefill(weights, ids, mask, slots)
        else:
            logits = self._extend(weights, ids, positions, slots, base)
        self.timing["prompt_tokens"] += sum(len(p) for p in prompts)
        self.timing["reused_tokens"] += 0 if state is None else sum(cached)
        tok, logp = sample(logits, slots.u[0], sampling)
        self._record(slots, tok, logp)
        self._sync()
        self.timing["prefill_s"] += time.perf_counter() - t0
        return _Batch(prompts, weights, sampling, lane, slots, graph, columns, state, base + width)

    def _advance(self, b: "_Batch") -> bool:
        """One decode step of ``b``; whether it has more to do (every 16 steps it asks the device)."""
        if b.graph is not None:
            b.graph.replay()
        else:
            self._step(b.slots, b.columns, b.weights, b.sampling)
        b.t += 1
        return b.t < b.sampling.max_new_tokens and not (b.t % 16 == 0 and bool(b.slots.done.all()))

    def _decode(self, batches: list["_Batch"]) -> None:
        """Decode the batches to their ends, a step of each in turn.

        With CUDA graphs each batch replays on its own stream, so two batches' steps run at once: at a
        few rows a step's kernels leave most of the GPU idle (a 16-row step costs about a 32-row one).
        Their wall-clock counts once in ``timing["decode_s"]``.
        """
        streams = [None] * len(batches)
        if len(batches) > 1 and self.graphs:
            if len(self._streams) < len(batches):
                self._streams = [torch.cuda.Stream(self.device) for _ in batches]
            streams = self._streams[: len(batches)]
            for stream in streams:
                stream.wait_stream(torch.cuda.current_stream())
        t1 = time.perf_counter()
        live = [(b, stream) for b, stream in zip(batches, streams, strict=True) if b.t < b.sampling.max_new_tokens]
        while live:
            for b, stream in list(live):
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    if not self._advance(b):
                        live.remove((b, stream))
        self._sync()
        self.timing["decode_s"] += time.perf_counter() - t1
        for b in batches:
            self.timing["decode_steps"] += b.t - 1
            self.timing["row_steps"] += (b.t - 1) * len(b.prompts)

    def _finish(self, b: "_Batch"):
        """A decoded batch's completions and log-probs (trimmed); what its lane may continue next turn."""
        prompts, slots, lane, state, n, t = b.prompts, b.slots, b.lane, b.state, len(b.prompts), b.t
        if not bool(slots.out_logp[:n].isfinite().all()):
            raise FloatingPointError("the rollout sampled from non-finite logits: the policy weights hold NaN/inf")
        trimmed = self._trim(slots.out_tok[:n].cpu())
        lps = slots.out_logp[:n].tolist()
        if lane is not None and state is None:  # what the next turn of this lane may continue
            self._lanes[lane] = _Lane(n=n, starts=slots.pad_start[:n].tolist(),
                                      tokens=[p + c[:-1] for p, c in zip(prompts, trimmed, strict=True)],
                                      end=b.end + t - 1)
        return trimmed, [lp[: len(t)] for lp, t in zip(lps, trimmed, strict=True)]

    def _continues(self, state: _Lane | None, prompts) -> tuple[_Lane, list[int]] | None:
        """The lane state and each row's cached length, if any row's prompt continues what is cached."""
        if state is None or state.n != len(prompts):
            return None
        cached = [len(t) if len(p) > len(t) and p[: len(t)] == t else 0 for p, t in zip(prompts, state.tokens, strict=True)]
        return (state, cached) if any(cached) else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _record(self, slots: _Slots, tok, logp) -> None:
        """Store the token sampled at ``slots.step``; advance the state to the next step."""
        tok = torch.where(slots.done, torch.full_like(tok, self.pad_id), tok)
        slots.out_tok.index_copy_(1, slots.step, tok[:, None])
        slots.out_logp.index_copy_(1, slots.step, logp[:, None].float())
        slots.done |= torch.isin(tok, self.eos)
        slots.tok.copy_(tok)
        slots.step += 1

    def _step(self, slots: _Slots, columns: int, weights: FusedWeights, sampling: Sampling) -> None:
        """One decode step, all on the device (captured as one CUDA graph on a GPU)."""
        u = slots.u.index_select(0, slots.step.clamp(max=slots.steps - 1))[0]
        nxt, logp, k, v = decode_math(
            self._layer_for(slots.tok.size(0)), weights.tensors, weights.inv_freq, weights.rope_scale, self.arch.eps, slots.tok, slots.pos,
            slots.col, slots.pad_start, slots.hole, u, slots.k[:, :, :, :columns], slots.v[:, :, :, :columns], sampling,
            slots.counters)
        if k is not None:
            slots.k.index_copy_(3, slots.col, k[:, :, :, None])
            slots.v.index_copy_(3, slots.col, v[:, :, :, None])
        slots.pos += 1
        slots.col += 1
        self._record(slots, nxt, logp)

    def _extend(self, weights: FusedWeights, ids, positions, slots: _Slots, base: int) -> torch.Tensor:
        """Prefill the new tokens ``ids`` (left-padded) at columns ``base`` on, over the cached prefixes."""
        width = ids.size(1)
        end = base + width
        cols = torch.arange(end, device=self.device)
        query_col = base + torch.arange(width, device=self.device)
        chunk = max(1, min(PREFILL_TOKENS // width, 4 * PREFILL_TOKENS // end))
        logits = []
        for s in range(0, ids.size(0), chunk):
            pad, hole = slots.pad_start[s : s + chunk, None, None], slots.hole[s : s + chunk, None]
            seen = _visible(cols, pad, hole[..., :1], hole[..., 1:], query_col[:, None] + 1)
            allowed = seen | (cols == query_col[:, None])  # a padding query sees itself: no softmax row is empty
            logits.append(extend_math(weights.tensors, weights.inv_freq, ids[s : s + chunk], positions[s : s + chunk],
                                      allowed, slots.k[:, s : s + chunk], slots.v[:, s : s + chunk], base, self.arch,
                                      weights.rope_scale, self._extend_layer))
        return torch.cat(logits)

    def _prefill(self, weights: FusedWeights, ids, mask, slots: _Slots) -> torch.Tensor:
        width = ids.size(1)
        chunk = max(1, PREFILL_TOKENS // width)
        logits = []
        for s in range(0, ids.size(0), chunk):
            lg, k, v = prefill_math(weights.tensors, weights.inv_freq, ids[s : s + chunk], mask[s : s + chunk],
                                    self.arch, weights.rope_scale, self._prefill_layer)
            slots.k[:, s : s + chunk, :, :width] = k
            slots.v[:, s : s + chunk, :, :width] = v
            logits.append(lg)
        return torch.cat(logits)

    # -- buffers and graphs -----------------------------------------------------------------------

    def _slots_for(self, rows: int, columns: int, steps: int, lane: tuple | None = None) -> _Slots:
        key = (rows, lane)
        slots = self._slots.get(key)
        if slots is None or slots.columns < columns or slots.steps < steps:
            old = slots
            if old is not None:  # grown: graphs over the old buffers are stale
                self._graphs = {k: g for k, g in self._graphs.items() if k[0] != key}
                # new captures take a fresh pool: capturing into a pool whose graphs are all gone trips
                # the caching allocator's assert (use_count > 0) when any of its blocks is still alive
                self._pools = {}
                del self._slots[key]
            columns = -(-max(columns, 4 * COLUMN_BUCKET, old.columns if old else 0) // COLUMN_BUCKET) * COLUMN_BUCKET
            slots = _Slots(self.arch, rows, columns, max(steps, old.steps if old else 0), self.dtype, self.device)
            if old is not None:  # a lane's cached prefixes move along
                slots.k[..., : old.columns, :].copy_(old.k)
                slots.v[..., : old.columns, :].copy_(old.v)
                del old
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self._slots[key] = slots
        return slots

    def _graph_for(self, slots: _Slots, rows: int, columns: int, weights: FusedWeights, sampling: Sampling,
                   lane: tuple | None = None):
        key = ((rows, lane), columns, weights.adapter, sampling.temperature, sampling.top_k, sampling.top_p)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        pool = self._pools.get(weights.adapter)
        if pool is None:
            pool = self._pools[weights.adapter] = torch.cuda.graph_pool_handle()
        # warm up (compiles on the first shapes) on a side stream, then capture one whole step; the
        # warm-up writes K/V in the last two columns, where no cached prefix lies
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        slots.col.fill_(columns - 2)
        slots.step.zero_()
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(slots, columns, weights, sampling)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # each weight set captures on its own stream: cuBLAS keys its workspace by stream and a graph
        # keeps the one it captured with, so the two sets' graphs, which may run at once, get their own
        capture = self._capture_streams.setdefault(weights.adapter, torch.cuda.Stream(self.device))
        with torch.cuda.graph(graph, pool=pool, stream=capture):
            self._step(slots, columns, weights, sampling)
        self._graphs[key] = graph
        self.captures += 1
        return graph
