"""Speed benchmark: the fast rollout engine against plain ``generate``, real recipe steps, a 600-chat eval.

Builds the Qwen2.5-1.5B architecture with random weights (no download) and, in one process:

1. **guard**: fp32 greedy tokens of the fast engine (compiled, CUDA graphs, merged weights) against
   ``generate`` on the PEFT model with a non-zero adapter, adapter and base rows in one call;
   **fold**: the engine's real fused weights carry the adapter as PEFT's own bf16 forward does
   (B set to k Adam-sized steps, k = 1, 5, 20; share of the fp32 adapter effect on the logits and
   cosine); the bench fails if the engine is more than 0.05 below PEFT on either;
2. **decode**: ms per decode step and tokens/s at batch 32 and 600, fixed turn length, for the fast
   engine and the baseline (plain eager ``generate`` with the unmerged adapter) on the same prompts;
3. **arms**: a few real training steps of every arm (TalkTrainer, fast engine): generation and
   training seconds, rows, chats drawn, peak memory, rollout-vs-trainer log-prob difference;
4. **eval**: one eval batch of 600 chats (4 turns);
5. **projection** of the full recipe (arms × seeds × steps, Ada's measured chats, every eval).

Random weights write noise: every turn runs to ``max_new_tokens`` (the fixed turn length), every
reward is 0, so Reinforce-Ada replays every problem to its limit (its worst case). Prints a table and
writes ``speed.json``.

    python bench/speed.py --out results/bench            # the full benchmark (a CUDA GPU)
    python bench/speed.py --model offline-tiny-qwen2 --quick --out /tmp/b   # the same code, tiny, on a CPU
"""

from __future__ import annotations

import time

T_PROCESS = time.perf_counter()  # before the heavy imports: an arm's own process counts them in its start-up

import argparse
import gc
import json
import logging
import platform
import shutil
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import talkmethods  # noqa: E402, F401  (its allocator default must precede torch's import)

# isort: split
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from talkmethods.atomic import write_json  # noqa: E402
from talkmethods.engines import ENGINES  # noqa: E402
from talkmethods.engines.fast import attention as da  # noqa: E402
from talkmethods.engines.fast import sampler as ds  # noqa: E402
from talkmethods.engines.fast.generator import (
    FastGenerator,  # noqa: E402
    batch_bucket,  # noqa: E402
)
from talkmethods.engines.plain import PlainGenerator, adapter_name  # noqa: E402
from talkmethods.engines.sampling import Sampling, sample_with_logprob  # noqa: E402
from talkmethods.models import ModelSpec, load_model, load_tokenizer, pick_device_and_dtype  # noqa: E402
from talkmethods.recipe import RUN_EVAL_KINDS  # noqa: E402

log = logging.getLogger("bench")
ARMS = ("grpo", "ada", "raft", "mixed")
# the full recipe both projections scale to (share.py's too)
RECIPE_STEPS, RECIPE_SEEDS, RECIPE_EVAL_CHATS = 80, 3, 600
# the training-step experiments the table lists beside Liger's pieces (compiled layers first: no layout)
PATCHED_STEPS = (
    "compiled_layers",
    "aligned",
    "liger+aligned",
    "packed",
    "liger+packed",
    "aligned+lora-bwd",
    "liger+aligned+lora-bwd",
    "aligned+lora-groups",
    "liger+aligned+lora-groups",
)


def recipe_evals(n_arms: int) -> int:
    """Evals the full recipe plays: every run's kinds (held-out and both cross-plays) plus the base's once."""
    return n_arms * RECIPE_SEEDS * len(RUN_EVAL_KINDS) + 1


def recipe_eval_jobs_one_per_run(n_arms: int) -> int:
    """Eval processes with ``eval.one_job_per_run: true``: one a run (its kinds together) plus the base's."""
    return n_arms * RECIPE_SEEDS + 1


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, *args):
    """``fn(*args)`` and its wall-clock seconds, the GPU drained before and after."""
    _sync()
    t0 = time.perf_counter()
    out = fn(*args)
    _sync()
    return out, time.perf_counter() - t0


def _peft(model, r: int, seed: int = 0, b_scale: float = 0.0):
    """Wrap ``model`` in the recipe's LoRA; ``b_scale`` > 0 makes the adapter change outputs."""
    from peft import LoraConfig, get_peft_model

    from talkmethods.training.build import LORA_TARGETS

    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(LORA_TARGETS)))
    if b_scale:
        _random_b(model, "lora_B", seed, b_scale)
    return model.eval()


def _random_b(model, prefix: str, seed: int, b_scale: float) -> None:
    """Every LoRA B matrix whose name holds ``prefix`` drawn at random (``b_scale`` times a normal)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if prefix in name:
                p.copy_((torch.randn(p.shape, generator=g) * b_scale).to(p.dtype))


def add_adapter(model, name: str, r: int, seed: int, b_scale: float) -> str:
    """Another LoRA adapter on ``model`` (a seed cohort's), the recipe's shape, its own non-zero B."""
    from peft import LoraConfig

    from talkmethods.training.build import LORA_TARGETS

    model.add_adapter(name, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(LORA_TARGETS)))
    _random_b(model, f"lora_B.{name}.", seed, b_scale)
    return name


def _prompts(tokenizer, n: int, width: int, seed: int = 0) -> list[list[int]]:
    """``n`` chat prompts of about ``width`` tokens (random words: the cost depends on length only)."""
    g = torch.Generator().manual_seed(seed)
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    body = torch.randint(1000, 100_000, (n, max(width - len(head), 1)), generator=g).tolist()
    return [list(head[:-5]) + row + list(head[-5:]) for row in body]


def guard(spec: ModelSpec, tokenizer, device, args) -> dict:
    """fp32 greedy tokens: fast engine == generate, adapter and base rows in one call."""
    model = _peft(load_model(spec, torch.float32, device), r=args.lora_r, b_scale=0.2)
    prompts = _prompts(tokenizer, 8, 64, seed=1)
    adapter_on = [True, False] * 4
    greedy = Sampling(max_new_tokens=args.guard_tokens, top_k=1)
    plain = PlainGenerator(model, tokenizer).generate(prompts, adapter_on, greedy)
    fast = FastGenerator(model, tokenizer, attention=args.attention[0])
    got = fast.generate(prompts, adapter_on, greedy)
    got_logprobs = fast.last_logprobs
    base_only = fast.generate(prompts, [False] * 8, greedy)
    # eval.engine fast-eager: the same engine's maths uncompiled, through its own CUDA graphs on a GPU
    eager = FastGenerator(model, tokenizer, attention=args.attention[0], compile=False).generate(
        prompts, adapter_on, greedy
    )
    # the log-probs the fast engine reports, against a plain forward of the PEFT model
    worst = 0.0
    with torch.no_grad():
        for i in range(len(prompts)):
            ids = torch.tensor([prompts[i] + got[i]], device=device)
            with model.disable_adapter() if not adapter_on[i] else nullcontext():
                lp = model(ids).logits[0, len(prompts[i]) - 1 : -1].float().log_softmax(-1)
            ref = lp.gather(-1, torch.tensor(got[i], device=device)[:, None])[:, 0].cpu()
            worst = max(worst, (ref - torch.tensor(got_logprobs[i])).abs().max().item())
    # a seed cohort's call: rows of three adapters and the base, as one batch per adapter (streams) and
    # as one stacked batch over the base weights
    cohort = [True, add_adapter(model, "seed1", args.lora_r, 1, 0.2), add_adapter(model, "seed2", args.lora_r, 2, 0.2)]
    cohort_on = [*cohort, False] * 2
    want = PlainGenerator(model, tokenizer).generate(prompts, cohort_on, greedy)
    by_form = {
        stack: FastGenerator(model, tokenizer, attention=args.attention[0], stack_adapters=stack).generate(
            prompts, cohort_on, greedy
        )
        for stack in (False, True)
    }
    kernel = _kernel_check(device, model.config) if da.available(device) else None
    sampler = _sampler_check(device, model.config.vocab_size) if ds.handles(device, 0, 1.0, 2) else None
    out = {
        "rows": len(prompts),
        "tokens_per_row": args.guard_tokens,
        "identical": got == plain,
        "decode_attention_bf16_max_abs_diff": kernel,
        "sampler": sampler,
        "rows_identical": sum(a == b for a, b in zip(got, plain, strict=True)),
        "eager_rows_identical": sum(a == b for a, b in zip(eager, plain, strict=True)),
        "cohort_rows_identical": sum(a == b for a, b in zip(by_form[False], want, strict=True)),
        "stacked_rows_identical": sum(a == b for a, b in zip(by_form[True], want, strict=True)),
        "cohort_adapters_differ": len({tuple(want[i]) for i in range(3)}) == 3,
        "adapter_changes_output": any(got[i] != base_only[i] for i in range(0, 8, 2)),
        "logp_max_abs_diff_fp32": worst,
        "graphs": fast.graphs,
        "attention": args.attention[0],
    }
    del model, fast
    _free()
    return out


def guard_error(g: dict) -> str | None:
    """The guard's verdict: in fp32 greedy every row of both fast forms, and of a cohort's call in both
    forms, is ``generate``'s, or why not."""
    counts = ("rows_identical", "eager_rows_identical", "cohort_rows_identical", "stacked_rows_identical")
    if all(g[k] == g["rows"] for k in counts):
        return None
    return (
        f"fp32 greedy tokens differ from generate's: fast {g['rows_identical']}/{g['rows']} rows, "
        f"fast-eager {g['eager_rows_identical']}/{g['rows']}, a cohort's call "
        f"{g['cohort_rows_identical']}/{g['rows']} (stacked {g['stacked_rows_identical']}/{g['rows']})"
    )


FOLD_STEPS = (1, 5, 20)
FOLD_DRAWS = 3  # random-sign B draws per k: one draw's share moves by a few hundredths
FOLD_SLACK = (
    0.05  # the engine may trail PEFT's bf16 forward by this much (mean share or cosine) before the bench fails
)


def _effect(delta: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Share of ``ref`` that ``delta`` carries (its projection on ``ref``) and their cosine."""
    delta, ref = delta.double().flatten(), ref.double().flatten()
    return (delta @ ref / (ref @ ref)).item(), F.cosine_similarity(delta, ref, dim=0).item()


def fold(spec: ModelSpec, tokenizer, device, args) -> dict:
    """Does the rollout carry the adapter as the trainer does? The fast engine folds ``B @ A`` into
    bf16 weights, so a change below half a bf16 step of a weight rounds away; PEFT's unmerged bf16
    forward loses a similar share to its own rounding. With ``B`` set to k Adam-sized steps of the
    recipe's lr (every entry ``k · lr`` in size, random sign), compare the change the adapter makes to
    the last-position logits of a batch of prompts against the fp32 PEFT model's change: the engine's
    fused weights (``FusedWeights``, the tensors its graphs read, through the engine's own prefill
    maths), PEFT's bf16 forward, and the trainer's (``fuse_lora_adds`` under bf16 autocast). Means over
    ``FOLD_DRAWS`` draws of B; fails when the engine trails PEFT by more than ``FOLD_SLACK``.
    """
    from peft import LoraConfig, get_peft_model

    from talkmethods.engines.fast.qwen2 import prefill_math
    from talkmethods.training.build import LORA_TARGETS
    from talkmethods.training.patches import fuse_lora_adds

    lr = 1e-4
    ref_model = load_model(spec, torch.float32, device)
    bf_model = load_model(spec, torch.bfloat16, device)
    bf_model.load_state_dict(ref_model.state_dict())  # the same weights, rounded to bf16
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=list(LORA_TARGETS))
    torch.manual_seed(0)
    ref_model = get_peft_model(ref_model, lora).eval()
    bf_model = get_peft_model(bf_model, lora).eval()
    bf_model.load_state_dict(ref_model.state_dict())  # the same A (and B, set below) in both
    fast = FastGenerator(bf_model, tokenizer, graphs=False, compile=False)
    ids = torch.tensor(_prompts(tokenizer, 16, 64, seed=2), device=device)
    mask = torch.ones_like(ids)
    names = [n for n, _ in ref_model.named_parameters() if "lora_B" in n]

    def logits(model, adapter: bool, trainer: bool = False) -> torch.Tensor:
        ctx = (
            torch.autocast(device.type if hasattr(device, "type") else str(device), torch.bfloat16)
            if trainer
            else nullcontext()
        )
        with torch.no_grad(), ctx, nullcontext() if adapter else model.disable_adapter():
            return model(ids, logits_to_keep=1).logits[:, -1].float()  # the vocabulary head on one position, not 64

    def engine(adapter: bool) -> torch.Tensor:
        w = fast.weights[adapter_name(adapter)]
        with torch.no_grad():
            return prefill_math(w.tensors, w.inv_freq, ids, mask, fast.arch, w.rope_scale)[0].float()

    paths = ("peft", "trainer", "engine")
    rows = []
    for k in FOLD_STEPS:
        got = {p: [] for p in paths}
        for draw in range(FOLD_DRAWS):
            g = torch.Generator().manual_seed(1000 * draw + k)
            signs = {
                n: torch.randn(p.shape, generator=g).sign() for n, p in ref_model.named_parameters() if n in names
            }
            with torch.no_grad():
                for model in (ref_model, bf_model):
                    for n, p in model.named_parameters():
                        if n in signs:
                            p.copy_((signs[n] * k * lr).to(p.device, p.dtype))
            fast.sync_weights()
            ref = logits(ref_model, True) - logits(ref_model, False)
            got["peft"].append(_effect(logits(bf_model, True) - logits(bf_model, False), ref))
            patched = [m for m in bf_model.modules() if "forward" not in vars(m)]
            fuse_lora_adds(bf_model)
            got["trainer"].append(_effect(logits(bf_model, True, True) - logits(bf_model, False, True), ref))
            for m in bf_model.modules():  # back to PEFT's own forward
                if m in patched and "forward" in vars(m):
                    del m.forward
            got["engine"].append(_effect(engine(True) - engine(False), ref))
        row = {"k": k, "effect_rms": ref.pow(2).mean().sqrt().item()}
        for p in paths:
            shares, coss = zip(*got[p], strict=True)
            row |= {
                f"{p}_share": round(sum(shares) / len(shares), 4),
                f"{p}_cos": round(sum(coss) / len(coss), 4),
                f"{p}_share_range": [round(min(shares), 4), round(max(shares), 4)],
            }
        rows.append(row)
    ok = all(
        r["engine_share"] >= r["peft_share"] - FOLD_SLACK and r["engine_cos"] >= r["peft_cos"] - FOLD_SLACK
        for r in rows
    )
    ref_model = bf_model = fast = None  # (not del: the closures above name them)
    _free()
    return {
        "lr": lr,
        "lora_r": args.lora_r,
        "prompts": ids.size(0),
        "draws": FOLD_DRAWS,
        "slack": FOLD_SLACK,
        "rows": rows,
        "ok": ok,
    }


def _kernel_check(device, cfg) -> float:
    """The Triton decode attention in bf16 at the model's shapes (batch 32, 700 of 1024 columns) against fp32 softmax."""
    kv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = cfg.num_attention_heads // kv
    gen = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)  # noqa: E731
    q, kn, vn, kc, vc = r(32, kv, g, d), r(32, kv, d), r(32, kv, d), r(32, kv, 1024, d), r(32, kv, 1024, d)
    pad = torch.randint(0, 300, (32,), generator=gen, device=device)
    want = da.reference(q.cpu(), kn.cpu(), vn.cpu(), kc.cpu(), vc.cpu(), pad.cpu(), 700, d**-0.5)
    got = da.decode_attention(
        q, kn, vn, kc, vc, pad, torch.tensor([700], device=device), d**-0.5, da.split_count(32, kv, 1024, 132)
    )
    return (got.float().cpu() - want).abs().max().item()


def _sampler_check(device, vocab: int, draws: int = 20) -> dict:
    """The Triton samplers against ``engine``'s torch rule on the same bf16 logits (batch 32, ``draws`` draws each).

    Plain sampling (temperature 1) and eval's (temperature 0.7, top-k 20, top-p 0.8). Tokens may differ
    only where ``u`` × total falls within fp32 rounding of a token boundary and, for top-k, where
    equal bf16 logits are ranked in another order (the kernels put the lower token id first).
    """
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    ev = EVAL_SAMPLING
    for name, (t, k, p) in {"plain": (1.0, 0, 1.0), "top": (ev["temperature"], ev["top_k"], ev["top_p"])}.items():
        same = rows = 0
        worst = 0.0
        for _ in range(draws):
            logits = (torch.randn(32, vocab, device=device, generator=gen) * 4).to(torch.bfloat16)
            u = torch.rand(32, device=device, generator=gen)
            if k:
                tok, logp = ds.sample_top_with_logprob(logits, t, k, p, u)
            else:
                tok, logp = ds.sample_with_logprob(logits, t, u)
            want, _ = sample_with_logprob(logits, t, k, p, u)
            same, rows = same + int((tok == want).sum()), rows + 32
            ref = (logits.float() / t).log_softmax(-1).gather(-1, tok[:, None])[:, 0]
            worst = max(worst, (logp - ref).abs().max().item())
        prefix = "" if name == "plain" else "top_"
        out |= {f"{prefix}same_tokens": same, f"{prefix}rows": rows, f"{prefix}logp_max_abs_diff": worst}
    return out


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode(spec: ModelSpec, tokenizer, device, dtype, args) -> list[dict]:
    """ms per decode step, fast engine vs plain generate (unmerged adapter), same prompts and length."""
    model = _peft(load_model(spec, dtype, device), r=args.lora_r, b_scale=0.01)
    rows = []
    steps = args.turn_tokens
    sampling = Sampling(max_new_tokens=steps)
    for batch in args.batches:
        prompts = _prompts(tokenizer, batch, args.prompt_tokens, seed=batch)
        on = [True] * batch
        for attention in args.attention:
            fast = FastGenerator(model, tokenizer, attention=attention)
            _, first_s = _timed(fast.generate, prompts, on, sampling)  # compile + capture + one full turn
            fast.timing = {k: 0 * v for k, v in fast.timing.items()}
            torch.manual_seed(0)
            _, wall = _timed(fast.generate, prompts, on, sampling)
            tm = fast.timing
            ms = 1000 * tm["decode_s"] / max(tm["decode_steps"], 1)
            rows.append(
                {
                    "engine": "fast" if attention == "auto" else f"fast ({attention} attention)",
                    "batch": batch,
                    "prompt_tokens": args.prompt_tokens,
                    "new_tokens": steps,
                    "decode_steps": tm["decode_steps"],
                    "ms_per_step": round(ms, 3),
                    "tokens_per_s": round(batch * 1000 / ms),
                    "prefill_s": round(tm["prefill_s"], 3),
                    "turn_s": round(wall, 3),
                    "first_turn_s": round(first_s, 1),
                }
            )
            log.info("%s", rows[-1])
            del fast
            _free()
        if args.baseline:
            plain = PlainGenerator(model, tokenizer)
            one = Sampling(max_new_tokens=1)
            plain.generate(prompts[:2], on[:2], one)  # warm-up
            _, t_prefill = _timed(plain.generate, prompts, on, one)
            outs, wall = _timed(plain.generate, prompts, on, Sampling(max_new_tokens=args.baseline_tokens))
            made = max(len(o) for o in outs)
            ms = 1000 * (wall - t_prefill) / max(made - 1, 1)
            rows.append(
                {
                    "engine": "plain generate (eager, unmerged LoRA)",
                    "batch": batch,
                    "prompt_tokens": args.prompt_tokens,
                    "new_tokens": made,
                    "decode_steps": made - 1,
                    "ms_per_step": round(ms, 3),
                    "tokens_per_s": round(batch * 1000 / ms),
                    "prefill_s": round(t_prefill, 3),
                    "turn_s": round(wall, 3),
                    "first_turn_s": None,
                }
            )
            log.info("%s", rows[-1])
            _free()
    del model
    _free()
    return rows


def _is_kernel(e) -> bool:
    """A GPU kernel row of ``key_averages`` (operator rows also carry their kernels' time: skip them)."""
    return getattr(e, "device_time_total", 0) > 0 and str(getattr(e, "device_type", "")).endswith("CUDA")


def profile_decode(spec: ModelSpec, tokenizer, device, dtype, args) -> dict:
    """Where a decode step's GPU time goes: the compiled step run without graphs under torch.profiler.

    Without graphs the host launches every kernel, so wall time means nothing here; the sum of kernel
    times per step is the GPU-busy time that a graph replay cannot go below.
    """
    from torch.profiler import ProfilerActivity, profile

    model = _peft(load_model(spec, dtype, device), r=args.lora_r, b_scale=0.01)
    fast = FastGenerator(model, tokenizer, graphs=False, compile=device.type == "cuda", attention=args.attention[0])
    batch = args.batches[0]
    prompts = _prompts(tokenizer, batch, args.prompt_tokens, seed=batch)
    sampling = Sampling(max_new_tokens=24)
    fast.generate(prompts, [True] * batch, sampling)  # compile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def kernels(max_new_tokens: int) -> dict[str, tuple[float, int]]:
        with profile(activities=acts) as prof:
            fast.generate(prompts, [True] * batch, Sampling(max_new_tokens=max_new_tokens))
        return {e.key: (e.device_time_total, e.count) for e in prof.key_averages() if _is_kernel(e)}

    # a turn of N tokens minus a prefill-only turn (one token): the kernels of N - 1 decode steps
    steps = sampling.max_new_tokens - 1
    full, pre = kernels(sampling.max_new_tokens), kernels(1)
    decode = {k: (t - pre.get(k, (0.0, 0))[0], n - pre.get(k, (0.0, 0))[1]) for k, (t, n) in full.items()}
    decode = {k: v for k, v in decode.items() if v[1] > 0}
    top = sorted(decode.items(), key=lambda kv: -kv[1][0])[:15]
    out = {
        "batch": batch,
        "prompt_tokens": args.prompt_tokens,
        "steps": steps,
        "attention": args.attention[0],
        "gpu_ms_per_step": round(sum(t for t, _ in decode.values()) / steps / 1000, 3),
        "kernels_per_step": round(sum(n for _, n in decode.values()) / steps),
        "top": [{"kernel": k[:90], "us_per_step": round(t / steps, 1), "calls": n} for k, (t, n) in top],
    }
    model = fast = None  # (not del: kernels() names them)
    _free()
    return out


KERNEL_KINDS = (  # first match wins; names as cuBLAS/cuDNN/inductor/ATen print them
    ("attention", ("fmha", "flash", "sdpa", "attention", "cutlassF", "cutlassB")),
    ("matmul", ("nvjet", "gemm", "gemv", "cutlass", "sm90_xmma", "splitk")),
    ("vocab head (log-prob, entropy)", ("log_softmax", "logsumexp", "cross_entropy", "nll_loss", "softmax")),
    ("optimizer", ("adam", "foreach")),
    ("copy / cast / pad", ("copy", "cat", "fill", "index", "scatter", "gather")),
    ("elementwise / fused", ("elementwise", "triton", "reduce", "vectorized")),
)


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def bench_problems() -> tuple[list[dict], list[dict]]:
    """The bench's problems: 32 to train on and 300 held out, generated (no data needed)."""
    from talkmethods.problems import load_gsm8k
    from talkmethods.split import draw_problems

    train_pool, test_pool = load_gsm8k("generated", seed=0, n_generated_train=64, n_generated_test=320)
    problems, held_out, _ = draw_problems(train_pool, test_pool, 32, 300, data_seed=0)
    return problems, held_out


def _train_config(arm: str, spec: ModelSpec, args, steps: int, liger: bool | None = None):
    """The recipe's training settings for ``arm`` (config.yaml's) at the bench's sizes, on the fast engine."""
    import dataclasses

    from talkmethods.config import load_config, train_params
    from talkmethods.recipe import TrainConfig

    recipe = TrainConfig.from_params(train_params(load_config([str(REPO / "config.yaml")]), arm, 17))
    return dataclasses.replace(
        recipe,
        model=spec,
        steps=steps,
        sampling=dataclasses.replace(recipe.sampling, max_new_tokens=args.turn_tokens),
        save_every=10_000,
        engine="fast",
        micro_batches=args.micro_batches,
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        problems_per_step=args.problems_per_step,
        ada_draw_ahead=args.ada_draw_ahead,
        pack_seats=args.pack_seats,
        liger_kernels=recipe.liger_kernels if liger is None else liger,
    )


def profile_train(spec: ModelSpec, device, args, problems, out: Path) -> dict:
    """Where a training step's GPU time goes: one real raft generation batch, its loss and backward.

    The rows come from a real rollout (fast engine); the step is TalkTrainer's own ``compute_loss``
    over the length-grouped micro-batches plus ``backward``, timed, then run again under
    torch.profiler and its kernels summed by kind.
    """
    from talkmethods.training.build import build_trainer
    from talkmethods.training.rows import group_by_length, width_step_for

    trainer = build_trainer(  # eager: Liger's kernels are one of the experiments below
        _train_config("raft", spec, args, steps=1, liger=False),
        problems,
        out / "work_profile",
        generator_factory=ENGINES["fast"],
    )
    model = trainer.model
    model.train()
    trainer.right_align_rows = False  # TRL's left-padded rows under a mask, as every round before; a variant below
    # random weights score 0: every row in the step (live_rows would leave them all out)
    trainer.skip_zero_advantage = False
    from talkmethods.training.patches import lora_groups, lora_own_backward

    # LoRA's backward through autograd's graph, as before round eighteen (apply_patches' node and its
    # groups are variants below)
    lora_own_backward(model, on=False)
    lora_groups(model, on=False)
    patched = [
        type(m).__name__
        for m in model.modules()
        if "liger" in type(m).__module__ or "liger" in getattr(m.__dict__.get("forward"), "__module__", "")
    ]
    if patched:
        raise RuntimeError(f"the profiled step's model runs Liger's modules ({patched[:2]}): not eager")
    trainer.current_gradient_accumulation_steps = args.micro_batches  # what Trainer's loop sets before a step
    g = trainer.num_generations
    inputs = [trainer.train_dataset[i] for i in range(args.problems_per_step) for _ in range(g)]
    batch = trainer._generate_and_score_completions(inputs)
    n_items = batch.pop("num_items_in_batch")
    parts = group_by_length(batch, args.micro_batches, width_step_for(device))  # as the trainer

    def step():
        total = 0.0
        for mb in parts:
            loss = trainer.compute_loss(model, {**mb, "num_items_in_batch": n_items})
            loss.backward()
            total += loss.detach()
        grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return float(total), grads

    step()  # allocator and autotuning warm-up
    _, wall = _timed(step)
    kern, kinds = _step_kernels(step, device)
    real = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
    padded = sum(mb["prompt_ids"].numel() + mb["completion_ids"].numel() for mb in parts)
    n_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    top = sorted(kern.items(), key=lambda kv: -kv[1][0])[:20]
    res = {
        "arm": "raft",
        "rows": int((batch["completion_mask"].sum(1) > 0).sum()),
        "micro_batches": len(parts),
        "turns": int(trainer._metrics["train"]["talk/rows"][-1]),
        "tokens_real": real,
        "tokens_padded": padded,
        "completion_tokens": int(n_items),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(real / wall),
        "tflops_4n": round(4 * n_params * real / wall / 1e12, 1),
        "gpu_ms": round(sum(t for t, _ in kern.values()) / 1000, 1),
        "by_kind_ms": {k: round(v / 1000, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top": [{"kernel": k[:110], "ms": round(t / 1000, 2), "calls": n} for k, (t, n) in top],
    }
    if (
        args.grad_check
        or args.train_compile
        or args.train_liger
        or args.train_aligned
        or args.train_packed
        or args.train_lora_backward
        or args.train_lora_groups
    ):
        res.update(_train_variants(trainer, batch, parts, step, device, args))
    log.info("%s", res)
    trainer = model = None  # (not del: step() names them)
    _free()
    return res


def _step_kernels(step, device) -> tuple[dict[str, tuple[float, int]], dict[str, float]]:
    """One ``step()`` under torch.profiler: each GPU kernel's (µs, calls), and µs summed by kind."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync()
    kern = {e.key: (e.device_time_total, e.count) for e in prof.key_averages() if _is_kernel(e)}
    kinds: dict[str, float] = {}
    for k, (t, _) in kern.items():
        kinds[_kind(k)] = kinds.get(_kind(k), 0.0) + t
    return kern, kinds


def _kernel_summary(step, device) -> dict:
    """One ``step()`` profiled: its kernels' ms by kind (largest first) and their total."""
    kern, kinds = _step_kernels(step, device)
    top = sorted(kern.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "by_kind_ms": {k: round(v / 1000, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "gpu_ms": round(sum(kinds.values()) / 1000, 1),
        "top": [{"kernel": k[:110], "ms": round(t / 1000, 2), "calls": n} for k, (t, n) in top],
    }


def _train_variants(trainer, batch, parts, step, device, args) -> dict:
    """Experiments on the profiled step: their gradients against eager's own spread and an fp32 reference.

    Random weights score 0 everywhere, so the advantages are set non-zero to make the comparison bite.
    Eager's noise floor: the same rows in other reduction orders (twice and half as many micro-batches,
    the micro-batches in reverse order): other matmul shapes and summation orders, the same maths. The
    fp32 reference is the same step with every weight in fp32 (then cast back: bf16 -> fp32 -> bf16 is
    exact); each variant's distance to it says whether a variant is less exact than eager bf16, which
    a distance to one eager run alone cannot.
    """
    from talkmethods.training.rows import group_by_length, width_step_for

    model = trainer.model
    n = len(parts)
    width = width_step_for(device)
    batch["advantages"] = torch.linspace(-1, 1, batch["advantages"].numel(), device=device).view_as(
        batch["advantages"]
    )

    def split(k: int, reverse: bool = False) -> None:
        parts[:] = group_by_length(batch, k, width)
        if reverse:
            parts.reverse()

    split(n)
    (loss_e, grads_e), wall_e = _timed(step)
    eager_runs = {f"eager, {n} micro-batches": grads_e}
    skipped = []
    for k, rev in ((2 * n, False), (max(n // 2, 1), False), (n, True)):
        split(k, rev)
        name = f"eager, {k} micro-batches" + (", reversed" if rev else "")
        try:
            eager_runs[name] = step()[1]
        except torch.OutOfMemoryError:  # fewer, bigger micro-batches may not fit an 80 GB card
            skipped.append(name)
            model.zero_grad(set_to_none=True)  # the micro-batches it got through left their gradients
            _free()
    # fp32 reference: every parameter in fp32 for one step (fp32 activations are twice as big: 4x the micro-batches)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    model.float()
    split(max(4 * n, 8))
    _, grads_32 = step()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.to(dtypes[name])
    split(n)

    def rel(g, ref):
        return float((g - ref).norm() / ref.norm().clamp(min=1e-30))

    out = {
        "eager": {"wall_s": round(wall_e, 3), "loss": loss_e},
        "eager_pairs": [
            {"what": f"{name} vs eager, {n}", "grad_rel_diff": rel(g, grads_e)}
            for name, g in list(eager_runs.items())[1:]
        ],
        "vs_fp32": {name: rel(g, grads_32) for name, g in eager_runs.items()},
        "eager_out_of_memory": skipped,
    }
    out["noise_floor"] = {
        "what": "the largest of " + "; ".join(p["what"] for p in out["eager_pairs"]),
        "grad_rel_diff": max(p["grad_rel_diff"] for p in out["eager_pairs"]),
    }
    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def measured(first_digits: int, timed: int = 3) -> dict:
        """The patched step: its first call (compile, autotune), a warm one, then ``timed`` timed (their
        median is its figure: one step's spread is ~1%, the size of the gaps these compare), against eager."""
        _, first = _timed(step)
        step()
        walls = []
        for _ in range(timed):
            (loss, grads), wall = _timed(step)
            walls.append(round(wall, 3))
        res = {
            "wall_s": sorted(walls)[len(walls) // 2],
            "walls_s": walls,
            "first_step_s": round(first, first_digits),
            "loss": loss,
            "grad_rel_diff": rel(grads, grads_e),
            "grad_rel_diff_fp32": rel(grads, grads_32),
        }
        log.info("patched step: %s", res)  # in the log as it comes (a section cut short writes no json)
        return res

    def patched(switch, record_failure: bool = True) -> dict:
        """The step with ``switch(True)``, timed and profiled, then ``switch(False)``. An experiment's failure
        (e.g. a torch whose varlen kernel has no backward) is recorded as its error unless ``record_failure``
        is off, so the section's other results are kept."""
        switch(True)
        try:
            return {**measured(2), **_kernel_summary(step, device)}
        except Exception as e:  # noqa: BLE001
            if not record_failure:
                raise
            return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            switch(False)

    def aligned() -> dict:
        """The step with each row's pads after its tokens and no attention mask (``patches.right_aligned_rows``)."""
        return patched(lambda on: setattr(trainer, "right_align_rows", on), record_failure=False)

    def packed() -> dict:
        """The step with each micro-batch's rows as one row of real tokens, no pads (``patches.packed_rows``)."""
        return patched(lambda on: setattr(trainer, "pack_rows", on))

    def lora_backward(grouped: bool = False) -> dict:
        """The aligned step with each LoRA layer one autograd node, x's gradient summed in place
        (``patches.lora_own_backward``); ``grouped``: q/k/v and gate/up one node each too, x read once a
        group and its gradient summed over the group in place (``patches.lora_groups``)."""
        from talkmethods.training.patches import lora_groups, lora_own_backward

        def switch(on: bool) -> None:
            trainer.right_align_rows = on
            lora_own_backward(model, on)
            lora_groups(model, on and grouped)

        return patched(switch)

    if args.train_liger:  # Liger's kernels patched in one at a time, cumulatively (not the LM head or loss)
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        saved = _qwen2_globals()

        pieces = {}
        for piece in ("rms_norm", "swiglu", "rope"):
            pieces[piece] = True
            apply_liger_kernel_to_qwen2(
                **{k: k in pieces for k in ("rope", "rms_norm", "swiglu")},
                cross_entropy=False,
                fused_linear_cross_entropy=False,
                model=base,
            )
            out["liger_" + "+".join(pieces)] = measured(2)
        out["liger"] = out["liger_" + "+".join(pieces)]
        # where the adopted step's time goes now, and whether other cuts of its rows pay
        out["liger"].update(_kernel_summary(step, device))
        out["liger_micro_batches"] = {}
        for k in sorted({max(n // 2, 1), max(n // 4, 1), 2 * n} - {n}):
            split(k)
            try:
                step()  # a new shape's first call
                _, wall = _timed(step)
                out["liger_micro_batches"][k] = round(wall, 3)
            except torch.OutOfMemoryError:  # fewer, bigger micro-batches may not fit an 80 GB card
                out["liger_micro_batches"][k] = "out of memory"
                _free()
        split(n)
        if args.train_aligned:
            out["liger+aligned"] = aligned()
        if args.train_packed:
            out["liger+packed"] = packed()
        if args.train_lora_backward:
            out["liger+aligned+lora-bwd"] = lora_backward()
        if args.train_lora_groups:
            out["liger+aligned+lora-groups"] = lora_backward(grouped=True)
        _restore_qwen2_globals(saved)  # (the instance keeps its patched modules)
    else:
        if args.train_aligned:
            out["aligned"] = aligned()
        if args.train_packed:
            out["packed"] = packed()
        if args.train_lora_backward:
            out["aligned+lora-bwd"] = lora_backward()
        if args.train_lora_groups:
            out["aligned+lora-groups"] = lora_backward(grouped=True)
    if args.train_compile:  # every decoder layer torch.compile'd (dynamic shapes), on top of Liger if asked
        for layer in base.model.layers:
            layer.compile(dynamic=True)
        try:
            out["compiled_layers"] = {**measured(1), "with_liger": bool(args.train_liger)}
        except Exception as e:  # noqa: BLE001 (an experiment: keep the section's other results)
            # e.g. Dynamo cannot trace Liger's RMSNorm kernel (H100, torch 2.11: AttributeError in its Triton source)
            out["compiled_layers"] = {
                "error": f"{type(e).__name__}: {str(e)[:300]}",
                "with_liger": bool(args.train_liger),
            }
    return out


def _qwen2_globals() -> dict:
    """modeling_qwen2's names that Liger replaces process-wide (RoPE, the norm and MLP classes)."""
    from transformers.models.qwen2 import modeling_qwen2

    return {k: getattr(modeling_qwen2, k) for k in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP")}


def _restore_qwen2_globals(saved: dict) -> None:
    """Undo Liger's process-wide patch, so that later trainers and sections build and run eager."""
    from transformers.models.qwen2 import modeling_qwen2

    for k, v in saved.items():
        setattr(modeling_qwen2, k, v)


def arms(spec: ModelSpec, device, args, problems, out: Path) -> list[dict]:
    """A few real recipe steps of every arm on the fast engine, each (arm, variant) in its own process.

    A real run is its own process (``snakemake`` starts one per run), so each arm here pays its own
    compile and capture and starts with a cold allocator, as a run does; ``--in-process`` runs them
    one after the other in this process instead (the method of the runs before 2026-12-04's second
    session: later arms came out warmer). With ``--arms-liger both`` each arm runs eager, then with Liger.
    """
    rows = []
    for arm, (variant, liger) in ((arm, v) for arm in args.arms for v in args.arms_liger):
        if args.in_process:
            saved = _qwen2_globals()
            rows += arm_rows(spec, args, problems, out, arm, variant, liger)
            _restore_qwen2_globals(saved)  # Liger patches modeling_qwen2 process-wide
            _free()
            continue
        rows += _own_process(
            args, ["--arm-worker", f"{arm}:{variant}", "--arm-result"], out / f"arm_{arm}_{variant}.json"
        )
    return rows


def _own_process(args, flags: list[str], result: Path):
    """This bench with ``flags`` and a result path in a fresh process (as Snakemake starts a job); its result."""
    cmd = [sys.executable, __file__, *args.argv, *flags, str(result)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(flags[:2])} failed in its own process: {done.stderr[-1500:]}")
    return json.loads(result.read_text())


def arm_rows(spec: ModelSpec, args, problems, out: Path, arm: str, variant: str, liger: bool | None) -> list[dict]:
    """One arm's bench run: ``args.steps`` recipe steps, a row per step."""
    from talkmethods.training.build import build_trainer
    from talkmethods.training.runs import StepLog

    rows = []
    cfg = _train_config(arm, spec, args, steps=args.steps, liger=liger)
    log_path = out / f"{arm}_{variant}_train_log.jsonl"  # in a scratch dir: the rows below keep what matters
    log_path.unlink(missing_ok=True)
    trainer = build_trainer(
        cfg, problems, out / f"work_{arm}_{variant}", callbacks=[StepLog(log_path)], generator_factory=ENGINES["fast"]
    )
    trainer.skip_zero_advantage = False  # random weights score 0: every row trained, the worst case, as before
    # a run's start-up as Snakemake's job pays it: interpreter, imports, tokenizer, model, trainer
    startup = None if args.in_process else time.perf_counter() - T_PROCESS
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _, wall = _timed(trainer.train)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    gen = trainer._generator
    for s in (json.loads(x) for x in log_path.read_text().splitlines()):
        rows.append(
            {
                "arm": arm,
                "variant": variant,
                "liger": trainer.liger,
                "process": "in-process" if args.in_process else "own",
                "step": s["step"],
                "chats": s["chats_drawn"],
                "chats_generated": s.get("chats_generated", s["chats_drawn"]),
                "rows": s["rows"],
                "loss_rows": s.get("loss_rows", s["rows"]),
                "tokens_per_turn": s["tokens_per_turn"],
                "longest_prompt": s["longest_prompt"],
                "loss_tokens": s["loss_tokens"],
                "loss_tokens_padded": s["loss_tokens_padded"],
                "gen_s": round(s["gen_s"], 3),
                "train_s": round(s["train_s"], 3),
                "logp_diff_max": s["logp_diff_max"],
                "logp_diff_mean": s["logp_diff_mean"],
                "peak_gib": round(peak, 1) if peak else None,
                "run_wall_s": round(wall, 1),
                "startup_s": None if startup is None else round(startup, 1),
                "graph_captures": gen.captures,
                "capture_s": round(gen.timing["capture_s"], 1),
                "decode_ms_per_step": round(1000 * gen.timing["decode_s"] / max(gen.timing["decode_steps"], 1), 3),
            }
        )
        log.info("%s", rows[-1])
    trainer = gen = None
    return rows


EVAL_SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}  # config.yaml's eval sampling (Qwen2.5-Instruct's)
EVAL_CHATS_PER_PROBLEM = 2


def eval_setup(spec: ModelSpec, device, dtype, args, problems) -> tuple:
    """An eval job's model (a LoRA that changes outputs), sampling, and ``--eval-chats`` / 2 problems."""
    model = _peft(load_model(spec, dtype, device), r=args.lora_r, b_scale=0.01)
    sampling = Sampling(max_new_tokens=args.turn_tokens, **EVAL_SAMPLING)
    need = args.eval_chats // EVAL_CHATS_PER_PROBLEM
    return model, sampling, (problems * (need // len(problems) + 1))[:need]


def eval_batch(spec: ModelSpec, tokenizer, device, dtype, args, problems) -> dict:
    """One eval batch: ``--eval-chats`` chats on the eval sampling settings, trained A × trained B."""
    from talkmethods.evaluate import play_eval

    model, sampling, flat = eval_setup(spec, device, dtype, args, problems)
    holder = {}

    def factory(m, t):
        holder["g"] = FastGenerator(m, t)
        return holder["g"]

    # an eval job's start-up as Snakemake's job pays it: interpreter, imports, tokenizer, model
    startup = None if args.in_process else time.perf_counter() - T_PROCESS
    chats, wall = _timed(
        play_eval, model, tokenizer, flat, "eval", sampling, EVAL_CHATS_PER_PROBLEM, args.eval_chats, factory
    )
    g = holder["g"]
    tm = g.timing
    out = {
        "chats": len(chats),
        "turns": 4,
        "turn_tokens": args.turn_tokens,
        "wall_s": round(wall, 1),
        "startup_s": None if startup is None else round(startup, 1),
        "prefill_s": round(tm["prefill_s"], 1),
        "decode_s": round(tm["decode_s"], 1),
        "capture_s": round(tm["capture_s"], 1),
        "rows_padded_to": batch_bucket(len(chats)),
        "ms_per_step": round(1000 * tm["decode_s"] / max(tm["decode_steps"], 1), 3),
        "tokens_per_s": round(tm["row_steps"] / max(tm["decode_s"], 1e-9)),
        "prompt_tokens": tm["prompt_tokens"],
        "reused_prompt_tokens": tm["reused_tokens"],
    }
    model = g = holder = None  # (not del: factory() names holder)
    _free()
    return out


def project(arm_rows: list[dict], ev: dict, args) -> dict:
    """Full recipe wall-clock: 4 arms × 3 seeds × 80 steps (steady steps, Ada's measured chats), plus evals."""
    per_arm = {}
    for arm in args.arms:
        steps = [r for r in arm_rows if r["arm"] == arm]
        if not steps:
            return {}
        steady = steps[1:] or steps
        step_s = sum(r["gen_s"] + r["train_s"] for r in steady) / len(steady)
        first_extra = max(steps[0]["gen_s"] + steps[0]["train_s"] - step_s, 0.0)
        startup = steps[0].get("startup_s") or 0.0  # own-process runs only
        per_arm[arm] = {
            "step_s": round(step_s, 2),
            "first_step_extra_s": round(first_extra, 1),
            "startup_s": startup,
            "run_s": round(args.recipe_steps * step_s + first_extra + startup, 1),
        }
    train_s = args.recipe_seeds * sum(v["run_s"] for v in per_arm.values())
    n_evals = recipe_evals(len(args.arms))
    eval_s = n_evals * (ev["wall_s"] * (args.recipe_eval_chats / ev["chats"]) + (ev.get("startup_s") or 0.0))
    return {
        "per_arm": per_arm,
        "training_s": round(train_s),
        "evals": n_evals,
        "eval_s": round(eval_s),
        "total_min": round((train_s + eval_s) / 60, 1),
        "assumes": f"{args.recipe_steps} steps × {args.recipe_seeds} seeds per arm; steady step time from steps "
        f"2..{args.steps} of each arm's bench run ("
        + ("one after the other in one process" if args.in_process else "each in its own process, as real runs")
        + "), the first step's extra (compile, capture) once per run"
        + ("" if args.in_process else ", and its start-up (imports, model, trainer)")
        + "; "
        f"{n_evals} evals of {args.recipe_eval_chats} chats at this run's eval wall-clock"
        + ("" if args.in_process else " and start-up")
        + "; "
        "turns at full length (random weights)",
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:qwen2.5-1.5b")
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the code path, measures nothing useful")
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated sections to skip: guard,fold,decode,arms,eval,profile,train_profile",
    )
    ap.add_argument("--no-baseline", dest="baseline", action="store_false")
    ap.add_argument(
        "--attention",
        default="auto",
        help="comma-separated attention forms of the decode section (auto, matmul, sdpa, triton); the first "
        "one also serves the guard and the profile",
    )
    ap.add_argument("--batches", default=None, help="comma-separated decode batch sizes (default 32,600)")
    ap.add_argument(
        "--ada-rounds",
        dest="ada_draw_ahead",
        action="store_false",
        help="Reinforce-Ada replays round by round (default: every round drawn ahead, as config.yaml)",
    )
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms of the arms section")
    ap.add_argument(
        "--arms-liger",
        choices=("config", "both", "off"),
        default="config",
        help="the arms' training forward: config.yaml's train.liger_kernels, 'off' (eager), or 'both' (eager first): "
        "today's and the new step times in one run",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="the arms' runs and the eval batch in this process (default: each in its own process, as Snakemake's jobs)",
    )
    ap.add_argument("--arm-worker", help=argparse.SUPPRESS)  # ARM:VARIANT, run by the arms section
    ap.add_argument("--arm-result", help=argparse.SUPPRESS)
    ap.add_argument("--eval-worker", help=argparse.SUPPRESS)  # a result path: the eval section's own process
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches a training step is split into (default 4, as config.yaml)",
    )
    ap.add_argument(
        "--train-compile",
        action="store_true",
        help="experiment: also time the profiled training step with every decoder layer torch.compile'd",
    )
    ap.add_argument(
        "--grad-check",
        action="store_true",
        help="the profiled step's gradients in several eager reduction orders and in fp32 (implied by the two below)",
    )
    ap.add_argument(
        "--train-liger",
        action="store_true",
        help="experiment: also time the profiled training step with Liger's RMSNorm, SwiGLU and RoPE kernels",
    )
    ap.add_argument(
        "--train-aligned",
        action="store_true",
        help="experiment: also time the profiled training step with each row's pads after its tokens and no "
        "attention mask (on top of Liger with --train-liger)",
    )
    ap.add_argument(
        "--train-packed",
        action="store_true",
        help="experiment: also time the profiled training step with each micro-batch's rows as one row of real "
        "tokens (varlen attention, no pads; on top of Liger with --train-liger)",
    )
    ap.add_argument(
        "--train-lora-backward",
        action="store_true",
        help="also time the profiled training step with rows right-aligned and each LoRA layer one autograd node "
        "summing x's gradient in place (patches.lora_own_backward, adopted; on top of Liger with --train-liger)",
    )
    ap.add_argument(
        "--train-lora-groups",
        action="store_true",
        help="also time the step of --train-lora-backward with q/k/v and gate/up one autograd node each "
        "(patches.lora_groups, adopted: x read once a group, its gradient summed over the group in place)",
    )
    ap.add_argument(
        "--no-pack",
        dest="pack_seats",
        action="store_false",
        help="one loss row per trained turn (default: a seat's two turns packed, as config.yaml)",
    )
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what an arm's own process is started with
    q = args.quick
    args.arms = args.arms.split(",")
    eager, config = ("eager", False), ("config", None)
    args.arms_liger = {"config": [config], "both": [eager, config], "off": [eager]}[args.arms_liger]
    args.batches = [int(b) for b in args.batches.split(",")] if args.batches else ([4, 8] if q else [32, 600])
    args.attention = args.attention.split(",")
    args.turn_tokens = 8 if q else 256
    args.prompt_tokens = 48 if q else 512
    args.baseline_tokens = 8 if q else 64
    args.guard_tokens = 8 if q else 48
    args.steps = 2 if q else 4
    args.micro_batches = args.micro_batches or (1 if q else 4)
    args.problems_per_step = 2 if q else 8
    args.lora_r = 4 if q else 32
    args.eval_chats = 8 if q else 600
    args.recipe_steps, args.recipe_seeds, args.recipe_eval_chats = RECIPE_STEPS, RECIPE_SEEDS, RECIPE_EVAL_CHATS
    skip = set(filter(None, args.skip.split(",")))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = pick_device_and_dtype()
    spec = ModelSpec(args.model)
    tokenizer = load_tokenizer(spec)
    problems, held_out = bench_problems()
    if args.eval_worker:  # the eval batch in its own process, for the parent's eval section
        write_json(Path(args.eval_worker), eval_batch(spec, tokenizer, device, dtype, args, held_out))
        return
    if args.arm_worker:  # one arm's run in its own process, for the parent's arms section
        arm, variant = args.arm_worker.split(":")
        liger = dict(args.arms_liger)[variant]
        scratch = Path(tempfile.mkdtemp(prefix="talkmethods-bench-arm-"))
        try:
            write_json(Path(args.arm_result), arm_rows(spec, args, problems, scratch, arm, variant, liger))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else f"cpu ({platform.machine()})"
    from importlib.metadata import version

    res = {
        "device": name,
        "model": args.model,
        "dtype": str(dtype).replace("torch.", ""),
        "versions": {p: version(p) for p in ("torch", "transformers", "trl", "peft")},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
    }

    def save():
        write_json(out / "speed.json", res)

    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="talkmethods-bench-"))
    sections = {
        "guard": lambda: guard(spec, tokenizer, device, args),
        "fold": lambda: fold(spec, tokenizer, device, args),
        "decode": lambda: decode(spec, tokenizer, device, dtype, args),
        "arms": lambda: arms(spec, device, args, problems, work),
        "eval": lambda: (
            eval_batch(spec, tokenizer, device, dtype, args, held_out)
            if args.in_process
            else _own_process(args, ["--eval-worker"], work / "eval.json")
        ),
        "profile": lambda: profile_decode(spec, tokenizer, device, dtype, args),
        "train_profile": lambda: profile_train(spec, device, args, problems, work),
    }
    for name, run in sections.items():
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            res[name] = run()
        except Exception as err:  # a failed section is reported; the others still run
            log.exception("section %s failed", name)
            res.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"[:2000]
            _free()
        res.setdefault("section_wall_s", {})[name] = round(time.perf_counter() - t0, 1)
        if name == "guard" and name in res and (why := guard_error(res[name])):
            res.setdefault("errors", {})[name] = why
        if name == "fold" and name in res and not res[name]["ok"] and not q:  # --quick measures nothing to hold to
            res.setdefault("errors", {})[name] = (
                f"the engine's folded adapter trails PEFT's bf16 forward by more than "
                f"{FOLD_SLACK} (share or cosine): {res[name]['rows']}"
            )
        save()
    shutil.rmtree(work, ignore_errors=True)
    if "arms" in res and "eval" in res:  # one projection per training forward the arms ran with
        for variant in sorted({r["variant"] for r in res["arms"]}):
            rows = [r for r in res["arms"] if r["variant"] == variant]
            key = "projection" + ("" if variant == "config" else "_eager")
            res[key] = project(rows, res["eval"], args)
            res[key]["liger"] = rows[0]["liger"]
    res["bench_wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(table(res))
    (out / "speed.md").write_text(table(res) + "\n")
    if "errors" in res:
        sys.exit(f"bench: sections failed: {', '.join(res['errors'])} (see speed.json)")


def table(res: dict) -> str:
    """The benchmark's results as markdown tables."""
    lines = [
        f"device: {res['device']}; model {res['model']} ({res['dtype']}, random weights); "
        f"torch {res['versions']['torch']}, transformers {res['versions']['transformers']}",
        "",
    ]
    if "guard" in res:
        g = res["guard"]
        lines += [
            f"guard (fp32, greedy, {g['rows']} rows × {g['tokens_per_row']} tokens, adapter and base rows in one call): "
            f"fast == generate: {g['identical']} ({g['rows_identical']}/{g['rows']} rows"
            + (f"; fast-eager: {g['eager_rows_identical']}/{g['rows']}" if "eager_rows_identical" in g else "")
            + (
                f"; a cohort's call: {g['cohort_rows_identical']}/{g['rows']}, stacked {g['stacked_rows_identical']}/{g['rows']}"
                if "stacked_rows_identical" in g
                else ""
            )
            + "); adapter changes output: "
            f"{g['adapter_changes_output']}; max |Δ log-prob| vs a plain forward: {g['logp_max_abs_diff_fp32']:.2e}"
            + (
                f"; Triton decode attention in bf16 vs fp32 softmax: max |Δ| {g['decode_attention_bf16_max_abs_diff']:.1e}"
                if g.get("decode_attention_bf16_max_abs_diff") is not None
                else ""
            )
            + (
                f"; Triton sampler vs torch's rule: {g['sampler']['same_tokens']}/{g['sampler']['rows']} tokens equal, "
                f"max |Δ log-prob| {g['sampler']['logp_max_abs_diff']:.1e}; with eval's top-k 20 and top-p 0.8: "
                f"{g['sampler']['top_same_tokens']}/{g['sampler']['top_rows']} equal, "
                f"max |Δ log-prob| {g['sampler']['top_logp_max_abs_diff']:.1e}"
                if g.get("sampler")
                else ""
            ),
            "",
        ]
    if "fold" in res:
        f = res["fold"]
        lines += [
            f"adapter fold (bf16, LoRA r={f['lora_r']}, B = k Adam-sized steps of lr {f['lr']:g}, mean of {f['draws']} draws; "
            f"the adapter's effect on the last-position logits of {f['prompts']} prompts against fp32 PEFT; fails if the "
            f"engine trails PEFT by > {f['slack']}): {'ok' if f['ok'] else 'FAILED'}"
            + (" (not enforced: --quick measures nothing)" if res["settings"]["quick"] else ""),
            "| k | effect rms | share: PEFT bf16 | trainer | engine | cosine: PEFT bf16 | trainer | engine |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['k']} | {r['effect_rms']:.2e} | {r['peft_share']:.3f} | {r['trainer_share']:.3f} | "
            f"{r['engine_share']:.3f} | {r['peft_cos']:.3f} | {r['trainer_cos']:.3f} | {r['engine_cos']:.3f} |"
            for r in f["rows"]
        ]
        lines.append("")
    if "decode" in res:
        lines += [
            "| engine | batch | prompt | new tokens | ms / decode step | tokens/s | prefill s | turn s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['engine']} | {r['batch']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['ms_per_step']:.2f} | "
            f"{r['tokens_per_s']:,} | {r['prefill_s']:.2f} | {r['turn_s']:.2f} |"
            for r in res["decode"]
        ]
        lines.append("")
    if "arms" in res:
        lines += [
            "| arm | Liger | step | chats used / played | turns / loss rows | tok/turn | gen s | train s | max Δlogp | peak GiB | ms/step |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['arm']} | {'yes' if r.get('liger') else 'no'} | {r['step']} | {r['chats']:.0f} / {r['chats_generated']:.0f} | {r['rows']:.0f} / {r['loss_rows']:.0f} | {r['tokens_per_turn']:.0f} | "
            f"{r['gen_s']:.2f} | {r['train_s']:.2f} | {r['logp_diff_max']} | {r['peak_gib']} | "
            f"{r['decode_ms_per_step']} |"
            for r in res["arms"]
        ]
        lines.append("")
    if "profile" in res:
        pr = res["profile"]
        lines += [
            f"decode profile (batch {pr['batch']}, {pr.get('attention', 'auto')} attention, compiled step without "
            f"graphs): {pr['gpu_ms_per_step']} ms of "
            f"GPU time per step in {pr['kernels_per_step']} kernels; top kernels (µs per step):"
        ]
        lines += [f"- {t['us_per_step']} µs in {t['calls'] / pr['steps']:.0f} calls: {t['kernel']}" for t in pr["top"]]
        lines.append("")
    if "train_profile" in res:
        t = res["train_profile"]
        lines += [
            f"training step profile ({t['arm']}, {t.get('turns', t['rows'])} turns in {t['rows']} rows, {t['micro_batches']} micro-batches, "
            f"{t['tokens_real']:,} real / {t['tokens_padded']:,} padded tokens, loss on {t['completion_tokens']:,}): "
            f"{t['wall_s']} s wall ({t['tokens_per_s']:,} tok/s, {t['tflops_4n']} TFLOP/s at 4·N a token), "
            f"{t['gpu_ms']} ms of kernels: " + ", ".join(f"{k} {v}" for k, v in t["by_kind_ms"].items()) + " ms"
        ]
        lines += [f"- {k['ms']} ms in {k['calls']} calls: {k['kernel']}" for k in t["top"]]
        if "noise_floor" in t:
            lines += [
                f"- gradient check (non-zero advantages; relative gradient norm against eager {t['eager']['wall_s']} s "
                "and against the same step in fp32):",
                "",
                "| variant | s a step | from eager | from fp32 |",
                "|---|---:|---:|---:|",
            ]
            first = next(iter(t["vs_fp32"]))
            lines.append(f"| {first} | {t['eager']['wall_s']} | — | {t['vs_fp32'][first]:.2e} |")
            for p in t.get("eager_pairs", []):
                name = p["what"].split(" vs ")[0]
                lines.append(f"| {name} | | {p['grad_rel_diff']:.2e} | {t['vs_fp32'].get(name, float('nan')):.2e} |")
            for name, c in t.items():  # the patched steps (not the micro-batch sweep beside them)
                if (name.startswith("liger_") or name in PATCHED_STEPS) and ("first_step_s" in c):
                    lines.append(
                        f"| {name.replace('_', ' ', 1)} (first step {c['first_step_s']} s) | {c['wall_s']}"
                        + (f" ({min(c['walls_s'])}–{max(c['walls_s'])})" if len(c.get("walls_s", [])) > 1 else "")
                        + " | "
                        f"{c['grad_rel_diff']:.2e} | {c.get('grad_rel_diff_fp32', float('nan')):.2e} |"
                    )
                elif name in PATCHED_STEPS and "error" in c:
                    lines.append(f"| {name} | failed: {c['error'][:200]} | | |")
            lines.append(
                f"- eager's noise floor: {t['noise_floor']['grad_rel_diff']:.2e} ({t['noise_floor']['what']})"
            )
            if "by_kind_ms" in t.get("liger", {}):
                lines.append(
                    f"- the Liger step's {t['liger']['gpu_ms']} ms of kernels: "
                    + ", ".join(f"{k} {v}" for k, v in t["liger"]["by_kind_ms"].items())
                    + " ms; other micro-batch counts: "
                    + ", ".join(
                        f"{k}: {v}" + (" s" * isinstance(v, float)) for k, v in t["liger_micro_batches"].items()
                    )
                )
            layouts = {
                "aligned": "rows' pads after their tokens, no attention mask",
                "packed": "rows as one row, no pads",
                "lora-bwd": "rows aligned, each LoRA layer one autograd node",
                "lora-groups": "rows aligned, q/k/v and gate/up one autograd node each",
            }
            for name in PATCHED_STEPS[1:]:
                if t.get(name, {}).get("by_kind_ms"):  # (a CPU's profile lists no GPU kernels)
                    lines.append(
                        f"- the {name} step's {t[name]['gpu_ms']} ms of kernels ({layouts[name.split('+')[-1]]}): "
                        + ", ".join(f"{k} {v}" for k, v in t[name]["by_kind_ms"].items())
                        + " ms"
                        + "".join(
                            f"; {k['kernel'][:60]} {k['ms']} ms ×{k['calls']}" for k in t[name].get("top", [])[:8]
                        )
                    )
        lines.append("")
    if "eval" in res:
        e = res["eval"]
        lines += [
            f"eval batch: {e['chats']} chats × 4 turns × {e['turn_tokens']} tokens in {e['wall_s']} s "
            f"(decode {e['decode_s']} s at {e['ms_per_step']} ms/step, batch padded to {e['rows_padded_to']}; "
            f"prefill {e['prefill_s']} s, {e.get('reused_prompt_tokens', 0):,} of {e.get('prompt_tokens', 0):,} prompt "
            f"tokens continued from the seat's cached turn; capture {e['capture_s']} s)"
            + (f"; the job's start-up (imports, model) {e['startup_s']} s" if e.get("startup_s") else ""),
            "",
        ]
    for key in ("projection_eager", "projection"):
        if res.get(key):
            p = res[key]
            lines += [
                f"projected full recipe, {'Liger' if p['liger'] else 'eager'} training forward: {p['total_min']} min "
                f"(training {p['training_s']} s, {p['evals']} evals {p['eval_s']} s); per arm: "
                + ", ".join(f"{a} {v['step_s']} s/step" for a, v in p["per_arm"].items()),
            ]
    if res.get("projection"):
        lines.append(f"({res['projection']['assumes']})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
