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


def test_sampler_applies_only_to_plain_sampling():
    torch = pytest.importorskip("torch")
    from talkmethods.engines.fast import sampler as ds

    gpu_or_interpreter = ds.handles(torch.device("cuda"), 0, 1.0, 100)
    assert not ds.handles(torch.device("cuda"), 20, 1.0, 100)
    assert not ds.handles(torch.device("cuda"), 0, 0.8, 100)
    assert (
        ds.handles(torch.device("cuda"), 100, 1.0, 100) == gpu_or_interpreter
    )  # top-k over the whole vocab is no top-k
