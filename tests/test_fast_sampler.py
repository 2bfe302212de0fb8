"""The fast engine's Triton sampler, run by Triton's interpreter on the CPU, against the torch sampling rule."""

from __future__ import annotations

import pytest

from tests.test_fast_attention import _interpret

pytest.importorskip("triton")

SAMPLER_CHECK = """
import torch
from talkmethods.engines.fast import sampler as ds
from talkmethods.engines.sampling import pick_token
torch.manual_seed(0)
picked = skipped = 0
worst = 0.0
# (rows, vocab, temperature): Qwen's vocabulary (a ragged last chunk), a vocab inside one chunk, peaked
# rows (most chunks without mass in fp32), a temperature
for rows, vocab, temperature, spread in [(6, 151_936, 1.0, 3.0), (5, 1000, 0.7, 2.0), (4, 20_000, 1.0, 60.0)]:
    for trial in range(3):
        logits = (torch.randn(rows, vocab) * spread).to(torch.bfloat16)
        u = torch.rand(rows)
        u[0] = 0.0  # the first token with mass
        u[1] = 1.0 - 2 ** -24  # the last token with mass
        tok, logp = ds.sample_with_logprob(logits, temperature, u)
        scaled = logits.float() / temperature
        want = pick_token(scaled, 0, 1.0, u)
        ref = scaled.log_softmax(-1)
        worst = max(worst, (logp - ref.gather(-1, tok[:, None])[:, 0]).abs().max().item())
        # where u·total falls within rounding of a token boundary, either side is the rule; elsewhere the tokens agree
        cdf = scaled.double().softmax(-1).cumsum(-1)
        for r in range(rows):
            near = (cdf[r] - u[r].double() * cdf[r, -1]).abs().min().item() < 1e-6
            if near:
                skipped += 1
                assert abs(int(tok[r]) - int(want[r])) <= 2 or ref[r, tok[r]] < -30, (r, tok[r], want[r])
            else:
                picked += 1
                assert int(tok[r]) == int(want[r]), (vocab, r, int(tok[r]), int(want[r]))
            assert ref[r, tok[r]] > -float("inf"), "a token without mass was picked"
print("PICKED", picked, "SKIPPED", skipped, "LOGPDIFF", worst)
"""


def test_sampler_picks_the_inverse_cdf_token_and_its_log_prob():
    out = _interpret(SAMPLER_CHECK)
    picked, skipped = int(out.split("PICKED")[1].split()[0]), int(out.split("SKIPPED")[1].split()[0])
    assert picked >= 20 and skipped <= 22, out  # 18 of the 45 rows sit at u = 0 or u → 1, on a boundary by design
    assert float(out.split("LOGPDIFF")[1]) < 1e-4, out


TOP_CHECK = """
import torch
import torch.nn.functional as F
from talkmethods.engines.fast import sampler as ds
from talkmethods.engines.sampling import _inverse_cdf, _nucleus, pick_token
torch.manual_seed(0)

def rule(scaled, k, top_p, u):
    # engines.sampling's rule with equal logits ranked by token id: a stable descending sort
    vals, ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(vals[:, :k], dim=-1)
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return ids[:, :k].gather(-1, _inverse_cdf(probs, u))[:, 0], probs

picked = skipped = 0
worst = 0.0
# (rows, vocab, temperature, spread, k, top_p, dtype): eval's settings on Qwen's vocabulary (a ragged last
# chunk), top-k alone inside one chunk, a last chunk with fewer logits than k, peaked rows (most chunks
# without mass), k = 64 on fp32 logits, every logit equal (ties everywhere)
cases = [
    (6, 151_936, 0.7, 3.0, 20, 0.8, torch.bfloat16),
    (5, 1000, 1.0, 2.0, 20, 1.0, torch.bfloat16),
    (4, 2048 + 10, 0.7, 2.0, 20, 0.8, torch.bfloat16),
    (4, 20_000, 0.7, 60.0, 5, 0.5, torch.bfloat16),
    (4, 5000, 1.0, 1.0, 64, 0.95, torch.float32),
    (3, 3000, 1.0, 0.0, 20, 0.8, torch.float32),
]
for rows, vocab, temperature, spread, k, top_p, dtype in cases:
    for trial in range(2):
        logits = (torch.randn(rows, vocab) * spread).to(dtype)
        u = torch.rand(rows)
        u[0] = 0.0  # the first token of the nucleus
        u[1] = 1.0 - 2 ** -24  # its last
        tok, logp = ds.sample_top_with_logprob(logits, temperature, k, top_p, u)
        scaled = logits.float() / temperature
        want, probs = rule(scaled, k, top_p, u)
        if dtype == torch.float32 and spread > 0:  # no ties: the sampling module's own rule, torch.topk included
            assert torch.equal(want, pick_token(scaled, k, top_p, u))
        ref = scaled.log_softmax(-1)
        worst = max(worst, (logp - ref.gather(-1, tok[:, None])[:, 0]).abs().max().item())
        # where u·total or the nucleus's edge falls within rounding, either side is the rule
        p = probs.double()
        cdf = p.cumsum(-1)
        full = torch.softmax(torch.sort(scaled, dim=-1, descending=True, stable=True)[0][:, :k].double(), -1)
        before = full.cumsum(-1) - full
        for r in range(rows):
            near = (cdf[r] - u[r].double() * cdf[r, -1]).abs().min().item() < 1e-6
            near |= top_p < 1.0 and (before[r] - top_p).abs().min().item() < 1e-6
            kept = set(torch.sort(scaled[r], descending=True, stable=True)[1][:k].tolist())
            assert int(tok[r]) in kept, (vocab, r, int(tok[r]))  # never outside the k largest
            if near:
                skipped += 1
            else:
                picked += 1
                assert int(tok[r]) == int(want[r]), (vocab, k, r, int(tok[r]), int(want[r]))
print("PICKED", picked, "SKIPPED", skipped, "LOGPDIFF", worst)
"""


def test_top_k_top_p_kernels_pick_the_rules_token_and_its_log_prob():
    """Eval's sampling (top-k then top-p) as two kernels against engines.sampling's rule."""
    out = _interpret(TOP_CHECK)
    picked, skipped = int(out.split("PICKED")[1].split()[0]), int(out.split("SKIPPED")[1].split()[0])
    # 12 of the 52 rows sit at u → 1 by design, and the rows of equal logits at the nucleus's edge (16/20 = 0.8)
    assert picked >= 32 and skipped <= 20, out
    assert float(out.split("LOGPDIFF")[1]) < 1e-4, out


def test_sampler_applies_only_to_plain_sampling():
    torch = pytest.importorskip("torch")
    from talkmethods.engines.fast import sampler as ds

    gpu_or_interpreter = ds.handles(torch.device("cuda"), 0, 1.0, 100)
    assert not ds.handles(torch.device("cuda"), 20, 1.0, 100)
    assert not ds.handles(torch.device("cuda"), 0, 0.8, 100)
    assert (
        ds.handles(torch.device("cuda"), 100, 1.0, 100) == gpu_or_interpreter
    )  # top-k over the whole vocab is no top-k
    # the top-k kernels: a top-k up to MAX_TOP_K, with or without top-p; top-p alone stays torch's
    assert ds.handles_top(torch.device("cuda"), 20, 0.8, 151_936) == gpu_or_interpreter
    assert ds.handles_top(torch.device("cuda"), ds.MAX_TOP_K, 1.0, 151_936) == gpu_or_interpreter
    assert not ds.handles_top(torch.device("cuda"), ds.MAX_TOP_K + 1, 0.8, 151_936)
    assert not ds.handles_top(torch.device("cuda"), 0, 0.8, 151_936)
    assert not ds.handles_top(torch.device("cuda"), 1, 1.0, 151_936)  # greedy: torch's one topk
    assert not ds.handles_top(torch.device("cpu"), 20, 0.8, 151_936) or gpu_or_interpreter


AOT_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from talkmethods.engines.fast import sampler as ds
P, F, I = "*fp32", "fp32", "i32"
kernels = [
    (ds._chunk_stats, dict(logits_ptr="*bf16", stats_ptr=P, V=I, s_lb=I, temperature=F, NC=I), dict(CHUNK=2048)),
    (ds._pick, dict(logits_ptr="*bf16", stats_ptr=P, u_ptr=P, tok_ptr="*i64", logp_ptr=P, V=I, s_lb=I,
                    temperature=F, NC=I), dict(CHUNK=2048, NCP=128)),
    (ds._chunk_top, dict(logits_ptr="*bf16", stats_ptr=P, cv_ptr=P, ci_ptr="*i32", V=I, s_lb=I, temperature=F,
                         NC=I), dict(CHUNK=2048, K=20)),
    (ds._pick_top, dict(stats_ptr=P, cv_ptr=P, ci_ptr="*i32", u_ptr=P, tok_ptr="*i64", logp_ptr=P, V=I, NC=I,
                        top_p=F), dict(K=20, KP=32, NCP=128, NCAND=2048)),
]
for fn, sig, consts in kernels:
    sig = {**sig, **{k: "constexpr" for k in consts}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    print("COMPILED", fn.__name__, len(k.asm["cubin"]), k.metadata.shared)
"""


def test_sampler_kernels_compile_for_an_h100_class_gpu():
    """The interpreter runs what the GPU compiler may refuse: each kernel compiled ahead of time to sm_90
    (Triton's own ptxas; no GPU needed), as the eval's settings instantiate it."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", AOT_CHECK],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("COMPILED") == 4, out.stdout
    # a launch needs no shared-memory opt-in (48 KiB a block without it; Triton raises "out of resource" past the chip's)
    shared = {line.split()[1]: int(line.split()[3]) for line in out.stdout.splitlines() if line.startswith("COMPILED")}
    assert all(b <= 48 * 1024 for b in shared.values()), shared
