"""Does PyTorch's varlen attention (``patches.packed_rows``' kernel) work and pay on this GPU? (~10 s)

Sixteen rows of 450-1,200 tokens in Qwen2.5-1.5B's attention shape (12 query heads, 2 KV heads, dim 128),
bf16: the varlen call as ``patches._varlen_causal`` makes it against SDPA a row at a time (forward and
dQ), then one layer's attention forward + backward timed, varlen over the real tokens against causal SDPA
over the rows padded to the longest (what right-aligned rows run), and varlen with K/V already repeated
(what the copy costs where the kernel takes no ``enable_gqa``, as in torch 2.11).

    PYTHONPATH=$PWD python3 bench/varlen_probe.py    # a CUDA GPU of sm80+
"""

import inspect
import time

import torch
import torch.nn.functional as F

from talkmethods.training.patches import _varlen_causal, packed_rows_available


def _ms(f, n: int = 20) -> float:
    f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    dev = torch.device("cuda")
    if not torch.cuda.is_available() or not packed_rows_available(dev):
        raise SystemExit("varlen_probe: needs PyTorch's varlen attention on a CUDA GPU of sm80+")
    from torch.nn.attention.varlen import varlen_attn

    print(torch.__version__, torch.cuda.get_device_name(0), inspect.signature(varlen_attn))
    torch.manual_seed(0)
    lens = torch.randint(450, 1200, (16,)).tolist()
    n, w, scale = sum(lens), max(lens), 128**-0.5
    cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(torch.int32).to(dev)

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, requires_grad=True)

    q, k, v = leaf(n, 12, 128), leaf(n, 2, 128), leaf(n, 2, 128)
    out = _varlen_causal(q, k, v, cu, w, scale)
    out.float().square().sum().backward()
    dq = q.grad.clone()
    q.grad = None
    bounds = cu.tolist()
    ref = torch.cat(
        [
            F.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    )
    ref.float().square().sum().backward()
    print(
        f"varlen against SDPA a row at a time: output max abs diff {float((out - ref).abs().max()):.3g}, "
        f"dQ relative {float((dq - q.grad).float().norm() / q.grad.float().norm()):.3g}"
    )
    qp, kp, vp = leaf(16, 12, w, 128), leaf(16, 2, w, 128), leaf(16, 2, w, 128)
    padded = _ms(lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True).sum().backward())
    packed = _ms(lambda: _varlen_causal(q, k, v, cu, w, scale).sum().backward())
    kr = k.detach().repeat_interleave(6, dim=1).requires_grad_()
    vr = v.detach().repeat_interleave(6, dim=1).requires_grad_()
    repeated = _ms(lambda: _varlen_causal(q, kr, vr, cu, w, scale).sum().backward())  # 12 KV heads: no copy
    print(
        f"one layer's attention, forward + backward, {n:,} real / {16 * w:,} padded tokens: causal SDPA on "
        f"padded rows {padded:.3f} ms, varlen {packed:.3f} ms, varlen with K/V already repeated {repeated:.3f} ms"
    )


if __name__ == "__main__":
    main()
