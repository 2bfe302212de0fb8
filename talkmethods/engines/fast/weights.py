"""The fast engine's weights: a fused inference copy of a Qwen2 policy, the LoRA adapter folded in.

``FusedWeights`` holds, per layer, q/k/v and gate/up fused into one matrix each with one adapter's
``W + s·B·A`` merged in (or the base weights, for base-seat turns), rewritten in place by ``refresh``
after each optimizer step so that captured CUDA graphs keep reading the same addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from talkmethods.engines.plain import adapter_name


@dataclass(frozen=True)
class Arch:
    """The shapes of a Qwen2 model that the maths needs, read from its HF config."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def of(cls, config) -> Arch:
        if getattr(config, "model_type", None) not in ("qwen2",):
            raise ValueError(
                f"the fast engine runs Qwen2-architecture models, not {config.model_type!r}: set train.engine and eval.engine to loop"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            config.rms_norm_eps,
        )


def _base_model(model):
    """The HF CausalLM under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _effective_weight(linear, adapter: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (weight, bias) a possibly-LoRA Linear applies, the adapter named ``adapter`` folded in (``None``: none)."""
    if not hasattr(linear, "base_layer"):
        return linear.weight, linear.bias
    base = linear.base_layer
    weight = base.weight
    if adapter is not None and adapter in linear.lora_A:
        if linear.use_dora.get(adapter, False):
            raise ValueError("the fast engine does not merge DoRA adapters: set train.engine and eval.engine to loop")
        a = linear.lora_A[adapter].weight.float()
        b = linear.lora_B[adapter].weight.float()
        weight = (weight.float() + (b @ a) * linear.scaling[adapter]).to(weight.dtype)
    return weight, base.bias


class FusedWeights:
    """One fused inference copy of the policy's weights, with one of its adapters merged in or none.

    ``adapter``: the adapter's PEFT name (``None``: the base model; ``True``/``False`` mean the
    policy's own, ``default``, and none).

    Per layer: ``[in_norm, qkv_w, qkv_b, o_w, post_norm, gate_up_w, down_w]``; then ``[norm, embed, lm_head]``.
    Norms and embeddings are the model's own tensors (LoRA does not touch them); the fused matrices are
    owned here and rewritten in place by ``refresh`` so that captured CUDA graphs keep their addresses.
    """

    def __init__(self, model, adapter: str | bool | None):
        self.model, self.adapter = model, adapter_name(adapter) if isinstance(adapter, bool) else adapter
        hf = _base_model(model)
        self.arch = Arch.of(hf.config)
        self.tensors: list[torch.Tensor] = []
        with torch.no_grad():
            for layer in hf.model.layers:
                att, mlp = layer.self_attn, layer.mlp
                qkv_w, qkv_b = self._cat([att.q_proj, att.k_proj, att.v_proj])
                gu_w, _ = self._cat([mlp.gate_proj, mlp.up_proj])
                self.tensors += [
                    layer.input_layernorm.weight,
                    qkv_w,
                    qkv_b,
                    _effective_weight(att.o_proj, adapter)[0].clone(),
                    layer.post_attention_layernorm.weight,
                    gu_w,
                    _effective_weight(mlp.down_proj, adapter)[0].clone(),
                ]
            self.tensors += [hf.model.norm.weight, hf.model.embed_tokens.weight, hf.lm_head.weight]
        rope = hf.model.rotary_emb
        self.inv_freq = rope.inv_freq.float().clone()
        self.rope_scale = float(getattr(rope, "attention_scaling", 1.0))

    def _cat(self, linears) -> tuple[torch.Tensor, torch.Tensor]:
        ws, bs = zip(*(_effective_weight(lin, self.adapter) for lin in linears), strict=True)
        w = torch.cat(ws, 0)
        b = torch.cat(
            [
                bb if bb is not None else torch.zeros(ww.size(0), dtype=ww.dtype, device=ww.device)
                for ww, bb in zip(ws, bs, strict=True)
            ]
        )
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


class StackedWeights:
    """A seed cohort's adapters over the base weights, unmerged: one decode batch serves them all.

    Per layer the layout of ``FusedWeights``, each fused matrix a pair ``(W⊕A, Bᵀ)``: the base copy's
    matrix with the S adapters' ``A`` for it stacked below (q/k/v's and gate/up's side by side, r' rows
    an adapter), and ``Bᵀ`` (S, r', out) the adapters' ``B``, transposed for the batched product,
    block-diagonal where the matrix fuses several projections, the scaling folded in; the fused q/k/v
    bias gets zeros for the ``A`` rows. ``qwen2._linear`` applies a pair to rows in S equal groups,
    group ``s`` on ``adapters[s]``. ``refresh(adapter)`` rewrites one adapter's rows and slices in place.
    """

    FUSED = {1: ("q_proj", "k_proj", "v_proj"), 3: ("o_proj",), 5: ("gate_proj", "up_proj"), 6: ("down_proj",)}

    def __init__(self, model, base: FusedWeights, adapters: tuple[str, ...]):
        self.model, self.adapters, self.adapter = model, adapters, adapters  # ``adapter``: the set's key
        self.arch, self.inv_freq, self.rope_scale = base.arch, base.inv_freq, base.rope_scale
        self.tensors = list(base.tensors)
        layers = _base_model(model).model.layers
        with torch.no_grad():
            for i, layer in enumerate(layers):
                for slot, names in self.FUSED.items():
                    w = base.tensors[7 * i + slot]
                    linears = [self._linear_of(layer, n) for n in names]
                    rank = len(linears) * max(
                        (lin.lora_A[a].weight.size(0) for lin in linears for a in adapters if _has(lin, a)), default=1
                    )
                    wa = torch.cat([w, w.new_zeros(len(adapters) * rank, w.size(1))])
                    self.tensors[7 * i + slot] = (wa, w.new_zeros(len(adapters), rank, w.size(0)))
                    if slot == 1:  # the q/k/v bias, zero on the A rows
                        bias = base.tensors[7 * i + 2]
                        self.tensors[7 * i + 2] = torch.cat([bias, bias.new_zeros(len(adapters) * rank)])
        self.refresh()

    @staticmethod
    def _linear_of(layer, name: str):
        return getattr(layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp, name)

    @torch.no_grad()
    def refresh(self, adapter: str | None = None) -> None:
        """Copy the adapters' current LoRA matrices into place (``adapter``: only that one's)."""
        for i, layer in enumerate(_base_model(self.model).model.layers):
            for slot, names in self.FUSED.items():
                wa, b_t = self.tensors[7 * i + slot]
                out, rank = b_t.size(2), b_t.size(1)
                each = rank // len(names)
                for s, name in enumerate(self.adapters):
                    if adapter not in (None, name):
                        continue
                    row = 0  # the fused matrix's output rows of each projection
                    for j, lin in enumerate(self._linear_of(layer, n) for n in names):
                        size = lin.base_layer.weight.size(0) if hasattr(lin, "base_layer") else lin.weight.size(0)
                        if _has(lin, name):
                            if lin.use_dora.get(name, False):
                                raise ValueError(
                                    "the fast engine does not merge DoRA adapters: set train.engine and eval.engine to loop"
                                )
                            a = lin.lora_A[name].weight
                            r = a.size(0)
                            first = out + s * rank + j * each
                            wa[first : first + r].copy_(a)
                            b_t[s, j * each : j * each + r, row : row + size].copy_(
                                (lin.lora_B[name].weight.float() * lin.scaling[name]).T
                            )
                        row += size


def _has(linear, adapter: str) -> bool:
    return hasattr(linear, "lora_A") and adapter in linear.lora_A
