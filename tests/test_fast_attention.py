"""The Triton decode-attention kernel, run by Triton's interpreter on the CPU.

The interpreter is switched on by ``TRITON_INTERPRET=1`` before ``triton`` is imported, so each
check runs in a fresh interpreter process. It runs float32 only: the interpreter's ``tl.dot`` reads
bfloat16 operands wrongly, so the bf16 kernel is checked on the GPU by ``bench/speed.py`` (guard).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

KERNEL_CHECK = """
import torch
from talkmethods.engines.fast import attention as da
torch.manual_seed(0)
worst = 0.0
# (rows, kv heads, group, head dim, cache columns, col, splits): several splits, one split, splits
# past the last used column, a group that is not a power of two, a row whose past is empty
for B, kv, g, d, S, col, splits in [(3, 2, 6, 128, 256, 200, 4), (2, 1, 4, 32, 128, 5, 3),
                                    (4, 2, 6, 64, 192, 191, 1), (2, 2, 3, 16, 512, 70, 8)]:
    q = torch.randn(B, kv, g, d)
    qkv = torch.randn(B, 3 * kv * d)  # K/V as strided views of one projection, as in the engine
    kn, vn = qkv[:, kv * d : 2 * kv * d].view(B, kv, d), qkv[:, 2 * kv * d :].view(B, kv, d)
    kc, vc = torch.randn(B, kv, S + 64, d)[:, :, :S], torch.randn(B, kv, S + 64, d)[:, :, :S]
    pad = torch.randint(0, col, (B,))
    pad[0] = col
    # no hole; then a hole per row (a reused prefix, stale columns, the new prompt): one empty, one
    # that starts at the row's first column, one wider than a split, one ending right before ``col``
    lo = torch.minimum(pad + torch.randint(0, 40, (B,)), torch.tensor(col))
    hi = torch.minimum(lo + torch.randint(1, 150, (B,)), torch.tensor(col))
    lo[-1] = hi[-1] = 0
    # and RoPE applied inside the kernel: q and the token's k arrive unturned, the cache gets the turned k
    angle = torch.rand(B, d // 2) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    turned = kn * cos[:, None] + torch.cat([-kn[..., d // 2 :], kn[..., : d // 2]], -1) * sin[:, None]
    for hole, rope in ((None, None), (torch.stack([lo, hi], 1).contiguous(), None), (None, (cos, sin))):
        want = da.reference(q, kn, vn, kc, vc, pad, col, 0.125, hole, *(rope or ()))
        before = kc.clone()
        got = da.decode_attention(q, kn, vn, kc, vc, pad, torch.tensor([col]), 0.125, splits, hole, *(rope or ()))
        assert torch.allclose(kc[:, :, col], turned if rope else kn, atol=1e-6), "token K not written"
        assert torch.equal(vc[:, :, col], vn), "token V not written"
        others = torch.ones(S, dtype=torch.bool)
        others[col] = False
        assert torch.equal(kc[:, :, others], before[:, :, others]), "other cache columns changed"
        worst = max(worst, (got - want).abs().max().item())
        assert not da._counters(q.device, B, kv).any(), "split counters not reset"
        if rope is not None:  # the turn mattered
            assert (got - da.reference(q, kn, vn, kc, vc, pad, col, 0.125)).abs().max() > 1e-3
        if hole is not None and ((hi > torch.maximum(lo, pad)) & (pad < col)).any():  # the hole's columns are left out
            assert (got - da.reference(q, kn, vn, kc, vc, pad, col, 0.125)).abs().max() > 1e-3
print("MAXDIFF", worst)
"""

ENGINE_CHECK = """
import torch
from conftest import chat_prompts
from tests.test_fast_engine import _lora, _logprobs_at_temperature, GREEDY
from talkmethods.engines.fast.generator import FastGenerator
from talkmethods.engines.plain import PlainGenerator
from talkmethods.engines.sampling import Sampling
from talkmethods.models import ModelSpec, load_model, load_tokenizer
torch.set_num_threads(1)
tok = load_tokenizer(ModelSpec("offline-tiny-qwen2"))
model = _lora(load_model(ModelSpec("offline-tiny-qwen2"), torch.float32))
prompts = chat_prompts(tok)
on = [True, False] * 3
want = PlainGenerator(model, tok).generate(prompts, on, GREEDY)
fast = FastGenerator(model, tok, attention="triton")
assert fast._auto_form(6) == "triton"
got = fast.generate(prompts, on, GREEDY)
# sampled tokens: their log-probs are a plain forward's (comparing samples across attention forms
# would not do: at temperature 1 a random model's 151,936 tokens sit ~1e-5 apart in the CDF, so
# fp32 rounding alone can move a draw)
torch.manual_seed(3)
out = fast.generate(prompts, on, Sampling(max_new_tokens=12, temperature=0.9))
diff = max((torch.tensor(lp) - _logprobs_at_temperature(model, p, c, a, 0.9)).abs().max().item()
           for p, c, lp, a in zip(prompts, out, fast.last_logprobs, on))
print("GREEDY", got == want, "LOGPDIFF", diff)
# the compiled pieces around the kernel (inductor's CPU backend here; on a GPU, Triton)
compiled = FastGenerator(model, tok, graphs=False, compile=True, attention="triton")
print("COMPILED", compiled.generate(prompts, on, GREEDY) == want)
# chats whose seats continue their cached turns (holes of several sizes) are generate's chats
# (the early stop is a token greedy play says fourth: generate's chats name it, the kernel's must match them)
from tests.test_fast_engine import _play_both, _plain_chats
stop = _plain_chats(model, tok)[0].turns[0].completion_ids[3]
lane, chats, plain = _play_both(model, tok, stop=stop, attention="triton")
print("LANES", [[t.completion_ids for t in c.turns] for c in chats] == [[t.completion_ids for t in c.turns] for c in plain],
      lane.timing["reused_tokens"] > 0)
"""


def _interpret(code: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # the repository (talkmethods, tests.*) and tests/ (conftest's helpers, as pytest puts it on the path)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_kernel_matches_softmax_attention_and_writes_only_the_token_column():
    out = _interpret(KERNEL_CHECK)
    assert float(out.split("MAXDIFF")[1]) < 1e-5, out


def test_engine_with_the_kernel_gives_generate_tokens_and_the_log_probs_of_a_forward():
    out = _interpret(ENGINE_CHECK)
    assert "GREEDY True" in out, out
    assert "LANES True True" in out, out
    assert "COMPILED True" in out, out
    assert float(out.split("LOGPDIFF")[1].split()[0]) < 1e-4, out


def test_split_count_fills_the_gpu_and_never_exceeds_the_column_blocks():
    from talkmethods.engines.fast.attention import BLOCK_N, PROGRAMS_PER_SM, split_count

    assert split_count(32, 2, 1024, 132) * 64 >= PROGRAMS_PER_SM * 132  # batch 32: enough programs for 132 SMs
    assert split_count(640, 2, 1024, 132) == 1  # batch 640 fills the GPU by itself
    assert split_count(1, 1, 100, 132) == -(-100 // BLOCK_N)
