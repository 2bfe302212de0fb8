"""Every change talkmethods makes to TRL's and PEFT's own code paths, in one file; none at import time.

Importing this module (or any of ``talkmethods.training``) changes nothing in TRL, PEFT or
transformers (tests/test_trl_contract.py::test_importing_talkmethods_training_patches_nothing).
Each patch leans on a library internal that a contract test pins, named in its docstring, so a TRL
or PEFT upgrade fails there with a message instead of silently doing something else.

Applied once, by ``apply_patches(model)``, which ``build.build_trainer`` calls on the built trainer's model:

- ``score_only_valid_positions_on_cpu``: TRL's fused LM head scores only the loss positions on a CPU too
  (process-wide; the warm start's SFT calls it as well).
- ``fuse_lora_adds``: the model's LoRA linear layers get a leaner forward (this model only),
  ``lora_own_backward`` makes that forward one autograd node with its own backward, and ``lora_groups``
  one node for each group of layers that read one input (q/k/v, gate/up).
- ``liger_kernels`` (``train.liger_kernels`` on a CUDA GPU): Liger's RMSNorm, SwiGLU and RoPE kernels.

Applied per call by ``TalkTrainer``'s overrides (``training.trainer``), undone when the call ends:

- ``lora_inputs_uncast`` (``compute_loss``): PEFT does not cast LoRA inputs to fp32 under bf16 autocast.
- ``unscored_labels_hook`` (``compute_loss``): the partner's reply in a packed row is not projected by the head.
- ``right_aligned_rows`` (``compute_loss``): each row's pads moved after its tokens, so attention runs causal with no mask.
- ``packed_rows`` (``compute_loss``, where ``TalkTrainer.pack_rows``; off, a bench experiment): a micro-batch's rows as one
  row of real tokens, no pads.
- ``replayable`` (``_get_train_sampler``): TRL's sampler replays its shuffle to any epoch (resume).
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F


def apply_patches(model, liger: bool = False) -> int:
    """Apply the run-wide patches for training ``model``; returns how many LoRA layers were fused.

    ``liger``: also Liger's kernels (``liger_kernels``); the caller asks only on a CUDA GPU.
    """
    score_only_valid_positions_on_cpu()
    if liger:
        liger_kernels(model)
    fused = fuse_lora_adds(model)
    lora_own_backward(model)
    lora_groups(model)
    return fused


def score_only_valid_positions_on_cpu() -> None:
    """Let TRL's fused LM head score only the completion tokens on a CPU too.

    Off Triton, ``trl.trainer.utils._fused_forward`` scores every position (prompt included) so that
    tile shapes stay fixed for compilers such as Neuron's; in eager CPU mode nothing recompiles, and
    scoring only the valid positions is the same maths at a fraction of the cost. Replaces
    ``trl.trainer.utils._use_triton`` (process-wide, idempotent).

    Contract: tests/test_trl_contract.py::test_fused_forward_looks_up_use_triton_at_call_time.
    """
    import trl.trainer.utils as trl_utils

    triton_check = trl_utils._use_triton
    if getattr(triton_check, "_talkmethods", False):
        return

    def compact(device: torch.device) -> bool:
        return device.type == "cpu" or triton_check(device)

    compact._talkmethods = True
    trl_utils._use_triton = compact


def unscored_labels_hook(scored: torch.Tensor | None):
    """A forward pre-hook: the partner's reply inside a packed row gets label -100, so it is not scored.

    TRL labels every attended completion token and its fused LM head projects every labelled
    position onto the 151,936-token vocabulary; the reply's positions are attended but outside the
    loss (``tool_mask`` 0), so projecting them only costs (a third of the head's work in a packed
    step). Their log-probs come back 0 and the loss masks them either way.

    Contract: tests/test_trl_contract.py::test_logps_come_from_the_fused_head_with_labels_as_a_keyword.
    """

    def hook(module, args, kwargs):
        labels = kwargs.get("labels")
        if scored is None or labels is None or not kwargs.get("fused_lm_head") or labels.size(0) != scored.size(0):
            return None
        labels = labels.clone()
        labels[:, labels.size(1) - scored.size(1) :].masked_fill_(scored == 0, -100)
        kwargs["labels"] = labels
        return args, kwargs

    return hook


PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def _block_rows(args, kwargs):
    """TRL's fused-head call on a left-padded batch whose rows are each one block of ones, else None.

    Returns (input_ids, the mask as bool, labels, each row's first attended column: 0 for an empty row):
    what ``right_aligned_rows`` and ``packed_rows`` re-lay out. Anything else (positional arguments, a
    pre-shifted or positioned call, a mask with holes) they leave as it is.
    """
    ids, mask, labels = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("labels")
    if args or ids is None or mask is None or labels is None or not kwargs.get("fused_lm_head"):
        return None
    if mask.dim() != 2 or kwargs.get("shift_labels") is not None or kwargs.get("position_ids") is not None:
        return None
    on = mask.bool()
    first = on.int().argmax(1)
    cols = torch.arange(on.size(1), device=on.device)
    block = (cols >= first[:, None]) & (cols < (first + on.sum(1))[:, None])
    return (ids, on, labels, first) if bool((block == on).all()) else None


def right_aligned_rows():
    """Forward hooks (pre, post) that run a left-padded micro-batch with every row's pads after its tokens.

    TRL lays a row out as ``[left pads][prompt][completion][right pads]`` and passes that padding mask,
    so attention needs an explicit mask (cuDNN's masked kernel on a GPU: 0.21 s of an H200 step, and the
    NaN of ``rows.CUDNN_NAN_WIDTH`` where a left pad's query row is fully masked). Rolled left by its
    left-pad count, a row reads ``[prompt][completion][pads]``: causal attention alone keeps every real
    token from seeing a pad, so the mask goes (``attention_mask=None``: SDPA's causal kernel). The labels
    roll with the tokens and the fused head's per-token outputs roll back, so the loss sees the same
    positions. The maths is the same: RoPE depends on position differences only (a row's positions now
    start at 0, as in the rollout engine). A batch whose rows are not one block of ones each (what TRL
    builds) runs unchanged.

    Contract: tests/test_trl_contract.py::test_logps_come_from_the_fused_head_with_labels_as_a_keyword
    (the call) and ::test_right_aligned_rows_give_the_fused_head_s_numbers (the numbers).
    """
    state: dict = {}

    def pre(module, args, kwargs):
        state.clear()
        rows = _block_rows(args, kwargs)
        if rows is None:
            return None
        ids, on, labels, first = rows
        width = on.size(1)
        idx = (torch.arange(width, device=on.device)[None, :] + first[:, None]) % width
        kwargs.update(input_ids=ids.gather(1, idx), labels=labels.gather(1, idx), attention_mask=None)
        state["first"] = first
        return args, kwargs

    def post(module, args, output):
        first = state.pop("first", None)
        if first is None:
            return None
        for name in PER_TOKEN_FIELDS:
            x = output.get(name) if hasattr(output, "get") else None
            if x is None or x.dim() != 2:
                continue
            # x[:, q - 1] scores the label at rolled column q; column p + 1 of the row went to (p + 1 - first)
            full = torch.cat([x.new_zeros(x.size(0), 1), x], dim=1)
            idx = (torch.arange(1, full.size(1), device=x.device)[None, :] - first[:, None]) % full.size(1)
            output[name] = full.gather(1, idx)
        return output

    return pre, post


PACKED_ATTENTION = "talkmethods_packed"  # the attention implementation packed rows switch the model to
_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a model's configs, listed once


def packed_rows_available(device: torch.device) -> bool:
    """Whether ``packed_rows`` runs its varlen kernel here: PyTorch's flash varlen, a CUDA GPU of sm80+."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.10)
    except ImportError:
        return False
    return True


@functools.cache
def varlen_params() -> frozenset[str]:
    """The keyword names this torch's ``varlen_attn`` takes, read once (each layer's call asks)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_causal(q, k, v, cu, max_len: int, scale: float):
    """Causal attention over packed sequences ([tokens, heads, dim]) with PyTorch's varlen kernel.

    Its signature moved between releases: 2.10 takes ``is_causal``, later ones ``window_size`` (causal
    is (-1, 0)); ``enable_gqa`` (2.13) lets two KV heads serve twelve query heads without copies.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = varlen_params()
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale - q.size(-1) ** -0.5) > 1e-12:
        raise RuntimeError(f"varlen_attn takes no scale here and the model's {scale} is not 1/sqrt(head_dim)")
    if k.size(1) != q.size(1):
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function for one packed row: causal within each ``cu_seq_lens_q`` span.

    ``query`` [1, heads, tokens, dim] as transformers passes it; returns [1, tokens, heads, dim]. On a
    CUDA GPU PyTorch's flash varlen kernel; elsewhere (the CPU tests) SDPA one sequence at a time, the
    same maths.
    """
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    scale = module.head_dim**-0.5 if scaling is None else scaling
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [tokens, heads, dim]
    if q.is_cuda:
        out = _varlen_causal(q.contiguous(), k.contiguous(), v.contiguous(), cu, max_len, scale)
    else:
        bounds = cu.tolist()
        parts = [
            F.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True
            ).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        out = torch.cat(parts)
    return out.unsqueeze(0), None


class packed_rows:  # noqa: N801  (a context manager used like a function, as the other patches)
    """Run each left-padded micro-batch as one row of its real tokens: no pad is computed at all.

    ``right_aligned_rows`` drops the mask but still runs every pad column through every layer (the
    rows of a micro-batch differ in length: ~9% of a 128-row step's tokens are pads, H200 round
    fourteen). Here the micro-batch's rows are concatenated ([1, real tokens]), each with positions
    from 0, attention causal within each row (PyTorch's flash varlen kernel over ``cu_seq_lens``,
    ``packed_attention``), and the fused head scores pre-shifted labels (``shift_labels``: each token
    against the next token of its own row). Its per-token outputs go back to TRL's [rows, width - 1]
    layout, so the loss sees the same positions with the same numbers: RoPE depends on position
    differences only, and no row attends to another.

    On entry it registers the hooks on ``model``; for the forward it switches the model's configs to
    ``PACKED_ATTENTION`` (and the layers' masks to None), restored in the post-hook and on exit. A
    batch whose rows are not one block of ones each runs unchanged, as in ``right_aligned_rows``.

    Contract: tests/test_trl_contract.py::test_packed_rows_give_the_fused_head_s_numbers (TRL's fused head
    scores ``shift_labels`` unshifted; transformers passes ``cu_seq_lens_q`` and a prepared mask dict
    through to the attention function; the numbers).
    """

    def __init__(self, model):
        from transformers import AttentionInterface, PretrainedConfig

        AttentionInterface.register(PACKED_ATTENTION, packed_attention)  # idempotent: a name -> a function
        self.model = model
        self.configs = _CONFIGS.get(model)
        if self.configs is None:  # listed once a model: a walk of every module is ms of host time a micro-batch
            self.configs = _CONFIGS[model] = list(
                {
                    id(m.config): m.config
                    for m in model.modules()
                    if isinstance(getattr(m, "config", None), PretrainedConfig)
                }.values()
            )
        self.saved: list | None = None
        self.handles: list = []
        self.state: dict = {}

    def __enter__(self):
        self.handles = [
            self.model.register_forward_pre_hook(self.pre, with_kwargs=True),
            self.model.register_forward_hook(self.post),
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self._restore()
        return False

    def _restore(self) -> None:
        if self.saved is not None:
            for config, impl in zip(self.configs, self.saved, strict=True):
                config._attn_implementation = impl
            self.saved = None

    def pre(self, module, args, kwargs):
        self.state.clear()
        rows = _block_rows(args, kwargs)
        if rows is None or not bool(rows[1].any()):
            return None
        ids, on, labels, _ = rows
        lengths = on.sum(1)
        # each token's label is the next column's, -100 past a row's end (its pads are -100 already)
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.size(0), 1), -100)], dim=1)
        used = lengths[lengths > 0]
        cu = F.pad(used.cumsum(0), (1, 0)).to(torch.int32)
        layers = getattr(self.configs[0], "layer_types", None) or ["full_attention"]
        kwargs.update(
            input_ids=ids[on][None],
            position_ids=(on.cumsum(1) - 1)[on][None],
            attention_mask=dict.fromkeys(set(layers)),  # a prepared mask per layer type: none
            labels=None,
            shift_labels=shifted[on][None],
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=int(used.max()),
            max_length_k=int(used.max()),
        )
        self.saved = [c._attn_implementation for c in self.configs]
        for config in self.configs:
            config._attn_implementation = PACKED_ATTENTION
        self.state["on"] = on
        return args, kwargs

    def post(self, module, args, output):
        self._restore()
        on = self.state.pop("on", None)
        if on is None:
            return None
        for name in PER_TOKEN_FIELDS:
            x = output.get(name) if hasattr(output, "get") else None
            if x is None or x.dim() != 2:
                continue
            # the packed token at (row, column c) scored the label at c + 1: TRL's column c of [rows, width - 1]
            output[name] = x.new_zeros(on.shape).masked_scatter(on, x[0])[:, :-1]
        return output


_TUNER_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a model's LoRA layers, listed once


@contextmanager
def lora_inputs_uncast(model, autocast_bf16: bool):
    """Under bf16 autocast, stop PEFT casting each LoRA layer's input to the adapter's fp32.

    PEFT keeps the adapter in fp32 and casts every LoRA input up to it (a full activation copy per
    layer, forward and backward); autocast then casts it straight back to bf16 for the matmul, so the
    round trip changes no number but cost ~0.4 s of each 128-row step on an H200. Without autocast
    (CPU, fp32) nothing is cast either way. What ``peft.helpers.disable_input_dtype_casting`` does, but
    with the model's LoRA layers listed once: that helper walks every module on entry and exit, ~25 ms
    of host time a micro-batch on Qwen2.5-1.5B (H100 profile, 2026-12-06).

    Contract: tests/test_trl_contract.py::test_lora_input_uncast_changes_no_number_under_bf16_autocast.
    """
    if not autocast_bf16:
        yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = _TUNER_LAYERS.get(model)
    if layers is None:
        layers = _TUNER_LAYERS[model] = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m.cast_input_dtype_enabled for m in layers]
    for m in layers:
        m.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for m, was in zip(layers, before, strict=True):
            m.cast_input_dtype_enabled = was


def _plain_adapter(self, x, args=(), kwargs=None) -> str | None:
    """The adapter a fused LoRA layer's call runs through ``_lora_forward``'s own sum, or None (PEFT's forward)."""
    name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
    if (
        args
        or kwargs
        or self.disable_adapters
        or self.merged
        or name not in self.lora_A
        or name in self.lora_variant
        or not isinstance(self.lora_dropout[name], torch.nn.Identity)
        # without autocast addmm needs one dtype (PEFT's forward casts the input to the adapter's)
        or not (
            torch.is_autocast_enabled(x.device.type)
            or x.dtype
            == self.lora_A[name].weight.dtype
            == self.lora_B[name].weight.dtype
            == self.base_layer.weight.dtype
        )
    ):
        return None
    return name


def _own_backward(self) -> bool:
    """``lora_own_backward`` is on for this layer and its base is frozen (a trained base keeps autograd's)."""
    return bool(self.__dict__.get("_own_backward")) and not any(p.requires_grad for p in self.base_layer.parameters())


def _lora_forward(self, x, *args, **kwargs):
    """PEFT's vanilla LoRA forward, ``base(x) + s·B(A(x))``, with the scaling applied to the r-wide
    ``A(x)`` and the add fused into the B product (``addmm``): two full-width elementwise passes a layer
    fewer, forward and backward. Anything but a plain single-adapter call goes to PEFT's own forward.
    """
    stash = self.__dict__.pop("_group_output", None)
    if stash is not None and stash[0] is x:  # lora_groups: this layer's output, made with its group's first
        return stash[1]
    name = _plain_adapter(self, x, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    if _own_backward(self):
        group = self.__dict__.get("_lora_group")
        if group is not None:
            names = [_plain_adapter(m, x) for m in group[1:]]
            if all(n is not None and _own_backward(m) for m, n in zip(group[1:], names, strict=True)):
                return _group_forward(x, group, [name, *names])
        # lora_own_backward: one autograd node, x's gradient summed in place
        return _LoraProduct.apply(
            x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
        )
    result = base(x)
    h = self.lora_A[name](x) * self.scaling[name]
    b = self.lora_B[name].weight
    flat = torch.addmm(result.reshape(-1, result.size(-1)), h.reshape(-1, h.size(-1)), b.t())
    return flat.view(result.shape).to(result.dtype)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast gives a linear layer's product here (the base weight's without autocast)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


class _LoraProduct(torch.autograd.Function):
    """``x·Wᵀ + bias + s·(x·Aᵀ)·Bᵀ`` (W frozen) as one autograd node with its own backward.

    Autograd's graph of the same sum (``_lora_forward``'s other path) writes x's gradient twice, once
    from the base product and once from the LoRA one, and then adds the two: a ``[tokens, in]``
    tensor written, read twice and written again for every LoRA layer. Here the LoRA part is summed
    into the base part in place (``addmm_``): two full-width passes fewer a layer, one rounding fewer.
    The maths is autograd's: products in the compute dtype (autocast's, or the weights' without it),
    the adapter's gradients returned in its own dtype (fp32 under bf16 autocast, as autocast's casts
    give back). Every call does its own casts, so the backward never relies on autocast's state (the
    CUDA backward runs on another thread, where autocast is off).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        dt = _compute_dtype(x, weight)
        shape = x.shape[:-1]
        x2 = x.reshape(-1, x.size(-1)).to(dt)
        w, a, b = weight.to(dt), lora_a.to(dt), lora_b.to(dt)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x2, w, None if bias is None else bias.to(dt))
            h = x2 @ a.t()
            y.addmm_(h, b.t(), alpha=scaling)  # s = alpha / r, a power of two in the recipe: exact
        ctx.save_for_backward(x2, h, w, a, b)
        ctx.scaling, ctx.dtypes = scaling, (x.dtype, lora_a.dtype, lora_b.dtype)
        return y.view(*shape, y.size(-1))

    @staticmethod
    def backward(ctx, dy):
        x2, h, w, a, b = ctx.saved_tensors
        s, (x_dt, a_dt, b_dt) = ctx.scaling, ctx.dtypes
        need_x, _, _, need_a, need_b, _ = ctx.needs_input_grad  # the base is frozen (_lora_forward checks)
        shape = dy.shape[:-1]
        dy2 = dy.reshape(-1, dy.size(-1)).to(w.dtype)
        dx = da = db = None
        with torch.autocast(dy.device.type, enabled=False):
            dh = (dy2 @ b).mul_(s)  # the gradient of h = x·Aᵀ (s folded in, as the forward's alpha)
            if need_b:
                db = (dy2.t() @ h).mul_(s).to(b_dt)
            if need_a:
                da = (dh.t() @ x2).to(a_dt)
            if need_x:
                dx = (dy2 @ w).addmm_(dh, a)  # the LoRA part summed into the base part in place
                dx = dx.view(*shape, dx.size(-1)).to(x_dt)
        return dx, None, None, da, db, None


def _group_forward(x, group: list, names: list[str]):
    """``group``'s layers on their common input ``x`` as one ``_LoraGroup`` node; the first layer's output
    is returned, each other layer's is left for its own call (``_lora_forward`` takes it back if its input
    is this ``x``, the same tensor)."""
    params = []
    for m, n in zip(group, names, strict=True):
        params += [m.base_layer.weight, m.base_layer.bias, m.lora_A[n].weight, m.lora_B[n].weight]
    outs = _LoraGroup.apply(x, tuple(m.scaling[n] for m, n in zip(group, names, strict=True)), *params)
    for m, y in zip(group[1:], outs[1:], strict=True):
        m._group_output = (x, y)
    return outs[0]


class _LoraGroup(torch.autograd.Function):
    """Several LoRA layers that read one input (q/k/v; gate/up) as one node: ``_LoraProduct``'s sums, and
    x's gradient summed over the whole group in place.

    Under ``_LoraProduct`` autograd still adds the group's input gradients (one per layer) into one,
    and each layer reads x again for its own ``x·Aᵀ``, forward and backward. Here the ``A`` products
    are one product with the group's ``A`` stacked (``x`` read once, forward and backward) and every
    layer's part of x's gradient is summed into the first's in place (``addmm_``): for q/k/v two
    full-width adds fewer a layer, for gate/up one. Otherwise the maths is ``_LoraProduct``'s: the
    compute dtype's products, the adapter's gradients in the adapter's dtype.
    """

    @staticmethod
    def forward(ctx, x, scalings: tuple, *params):
        ws, biases, las, lbs = params[0::4], params[1::4], params[2::4], params[3::4]
        dt = _compute_dtype(x, ws[0])
        shape = x.shape[:-1]
        x2 = x.reshape(-1, x.size(-1)).to(dt)
        w, b = [t.to(dt) for t in ws], [t.to(dt) for t in lbs]
        a = torch.cat([t.to(dt) for t in las])  # the group's A stacked: one product for every layer's x·Aᵀ
        ranks = [t.size(0) for t in las]
        with torch.autocast(x.device.type, enabled=False):
            h = x2 @ a.t()
            outs = []
            for wi, bias, hi, bi, s in zip(w, biases, h.split(ranks, 1), b, scalings, strict=True):
                y = F.linear(x2, wi, None if bias is None else bias.to(dt))
                outs.append(y.addmm_(hi, bi.t(), alpha=s).view(*shape, y.size(-1)))
        ctx.save_for_backward(x2, h, a, *w, *b)
        ctx.scalings, ctx.ranks, ctx.n = scalings, ranks, len(ws)
        ctx.dtypes = (x.dtype, [t.dtype for t in las], [t.dtype for t in lbs])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        x2, h, a, *rest = ctx.saved_tensors
        n, scalings, ranks = ctx.n, ctx.scalings, ctx.ranks
        w, b = rest[:n], rest[n:]
        x_dt, a_dts, b_dts = ctx.dtypes
        need = ctx.needs_input_grad  # (x, scalings, then weight, bias, A, B a layer)
        shape = dys[0].shape[:-1]
        dy2 = [dy.reshape(-1, dy.size(-1)).to(w[0].dtype) for dy in dys]
        grads: list = [None] * (4 * n)
        dx = None
        with torch.autocast(dys[0].device.type, enabled=False):
            dh = torch.cat([(d @ bi).mul_(s) for d, bi, s in zip(dy2, b, scalings, strict=True)], 1)
            da = dh.t() @ x2 if any(need[4::4]) else None
            for i, (d, hi, s) in enumerate(zip(dy2, h.split(ranks, 1), scalings, strict=True)):
                if need[2 + 4 * i + 3]:
                    grads[4 * i + 3] = (d.t() @ hi).mul_(s).to(b_dts[i])
            if da is not None:
                for i, dai in enumerate(da.split(ranks, 0)):
                    grads[4 * i + 2] = dai.to(a_dts[i]) if need[2 + 4 * i + 2] else None
            if need[0]:
                dx = dy2[0] @ w[0]
                for d, wi in zip(dy2[1:], w[1:], strict=True):
                    dx.addmm_(d, wi)  # each layer's part summed into the first's in place
                dx = dx.addmm_(dh, a).view(*shape, dx.size(-1)).to(x_dt)
        return dx, None, *grads


LORA_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # Qwen2's layers that read one input


def lora_groups(model, on: bool = True) -> int:
    """Make each group of fused LoRA layers that read one input (``LORA_GROUPS``: attention's q/k/v, the
    MLP's gate/up) one ``_LoraGroup`` node, or undo it; returns how many groups.

    On in every trainer (``apply_patches``), where ``lora_own_backward`` is on. Measured on an H100
    (2026-12-07, round nineteen), in one process: the 128-row raft step 1.233 → 1.193 s (elementwise
    kernels 60 → 41 ms, matmuls 864 → 840), its gradients as far from fp32 as before (4.66e-2 both);
    whole steps' loss half raft 1.324 → 1.276 s, Ada 1.451 → 1.421. ``on=False`` is the bench's "before"
    (``bench/speed.py --train-lora-groups``, ``bench/share.py --lora-ungrouped``).

    Leans on the order of Qwen2's calls: the group's first layer
    (q_proj, gate_proj) is called first, the others after it on the same input tensor; a layer whose input
    is another tensor computes its own sum as before, so another order costs speed, not numbers.
    Contract: tests/test_trl_contract.py::test_lora_groups_are_one_node_each_with_autograd_s_maths.
    """
    n = 0
    for module in model.modules():
        for names in LORA_GROUPS:
            layers = [getattr(module, k, None) for k in names]
            if all(
                m is not None and getattr(m.__dict__.get("forward"), "__func__", None) is _lora_forward for m in layers
            ):
                if on:
                    layers[0]._lora_group = layers
                else:
                    layers[0].__dict__.pop("_lora_group", None)
                for m in layers:
                    m.__dict__.pop("_group_output", None)
                n += 1
    return n


def lora_own_backward(model, on: bool = True) -> int:
    """Switch the fused LoRA layers of ``model`` (``fuse_lora_adds``) to ``_LoraProduct``, or back; returns how many.

    On in every trainer (``apply_patches``). Measured on an H100 (2026-12-07, round eighteen): the 128-row
    raft step 1.339 → 1.221 s (elementwise kernels 132 → 60 ms), its gradients as far from fp32 as
    before (4.68e-2 both); whole steps raft 4.28 → 4.12 s, Ada 6.35 → 6.14. ``on=False`` is the bench's
    "before" (``bench/speed.py --train-lora-backward``, ``bench/share.py --autograd-lora``). The same sum;
    its gradients differ from autograd's by the one rounding it saves
    (tests/test_trl_contract.py::test_lora_own_backward_is_autograd_s_maths).
    """
    n = 0
    for module in model.modules():
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) is _lora_forward:
            module._own_backward = on
            n += 1
    return n


def fuse_lora_adds(model) -> int:
    """Give every vanilla LoRA linear layer of ``model`` the fused forward above; returns how many.

    The same sum as PEFT's (its scaling, 2 in the recipe, is a power of two, so moving it is exact); the
    fused add rounds once where PEFT rounds the LoRA product and then the sum, a bf16 ulp at most.
    Measured on an H200, PEFT's scaling and add passes took ~0.24 s of a 128-row step. Sets ``forward``
    on each layer instance; PEFT's ``Linear`` class is untouched.

    Contract: tests/test_trl_contract.py::test_peft_lora_linear_forward_is_the_sum_fuse_lora_adds_fuses (the
    internals read) and ::test_fused_lora_forward_is_peft_s_sum_exactly_in_fp32_and_to_an_ulp_in_bf16 (the numbers).
    """
    from types import MethodType

    from peft.tuners.lora.layer import Linear as LoraLinear

    n = 0
    for module in model.modules():
        if type(module) is LoraLinear and "forward" not in vars(module) and module.lora_B:
            if all(m.bias is None for m in module.lora_B.values()):
                module.forward = MethodType(_lora_forward, module)
                n += 1
    return n


def replayable(sampler):
    """Give TRL's RepeatSampler a ``set_epoch`` that replays its shuffle generator to that epoch's start.

    The sampler draws one ``randperm`` per epoch from its own generator, seeded once with args.seed; HF's
    rng_state.pth holds only the global RNGs, so a resumed process restarts that generator and, from the
    2nd pass over the problems on, would deal them in the 1st pass's order. Trainer calls ``set_epoch``
    before every epoch (through accelerate's DataLoaderShard), resumed or not: an uninterrupted run keeps
    exactly its order, and a resumed one gets the same.

    Contract: tests/test_trl_contract.py::test_repeat_sampler_shuffles_once_an_epoch_and_trainer_sets_the_epoch
    (behaviour: tests/test_reliability.py::test_sampler_order_depends_only_on_seed_and_epoch).
    """
    if getattr(sampler, "shuffle", False) and getattr(sampler, "seed", None) is not None:

        def set_epoch(epoch: int) -> None:
            sampler.generator.manual_seed(sampler.seed)
            for _ in range(epoch):
                torch.randperm(sampler.num_samples, generator=sampler.generator)

        sampler.set_epoch = set_epoch
    return sampler


def liger_kernels(model) -> None:
    """Liger's fused RMSNorm, SwiGLU and RoPE kernels in ``model``'s forward and backward (a CUDA GPU only).

    Measured on an H200 (docs/h200_2026-12-04.md): the 128-row training step 1.72 -> 1.35 s, and its
    LoRA gradients 4.78e-2 from the same step in fp32 against eager bf16's 4.85e-2 (relative norm): as
    exact as eager. The LM head and the loss stay TRL's (no fused linear cross-entropy: TalkTrainer
    scores log-probs itself). Liger patches the instance's norms and MLPs, and process-wide
    ``modeling_qwen2``'s RoPE function and its RMSNorm and MLP classes (models built later in this
    process get them too: a training process builds no other Qwen2 model that runs on the GPU).

    Contract: tests/test_trl_contract.py::test_liger_patches_the_qwen2_pieces_the_recipe_names.
    """
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    apply_liger_kernel_to_qwen2(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=base
    )
