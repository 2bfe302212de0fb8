"""A/B experiments behind docs/speed_h200.md's change table, each in one process on a CUDA GPU.

Each runs the fast engine on the Qwen2.5-1.5B architecture with random weights (32 rows, 512-token
prompts, 256 new tokens), switching one thing on and off, and writes ``EXPERIMENT.json`` under ``--out``:

    python bench/ab.py sampler-ends --out results/ab        # Triton sampler and compiled step ends (h2)
    python bench/ab.py two-sets --out results/ab            # 16 adapter + 16 base rows: together vs one by one (h3)
    python bench/ab.py attention-splits --out results/ab    # split-KV programs per SM (h1)
    python bench/ab.py cohort-lora --out results/ab         # a seed cohort's decode projections: per-row LoRA
    python bench/ab.py cohort-decode --out results/ab       # a cohort's turn: a batch per adapter vs one stacked
    python bench/ab.py eval-sampler --out results/ab        # eval's top-k/top-p: Triton kernels vs torch's rule
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import talkmethods  # noqa: E402, F401  (its allocator default must precede torch's import)

# isort: split
import speed  # noqa: E402
import torch  # noqa: E402

from talkmethods.engines.fast import attention as da  # noqa: E402
from talkmethods.engines.fast import sampler as ds  # noqa: E402
from talkmethods.engines.fast.generator import FastGenerator  # noqa: E402
from talkmethods.engines.sampling import Sampling  # noqa: E402
from talkmethods.models import ModelSpec, load_model, load_tokenizer  # noqa: E402

TURN = Sampling(max_new_tokens=256)


def _decode_ms(gen, prompts, on, repeats: int = 3, sampling: Sampling = TURN) -> list[float]:
    """ms per decode step of ``repeats`` turns after a warm-up turn (compile and capture)."""
    gen.generate(prompts, on, sampling)
    out = []
    for _ in range(repeats):
        gen.timing = {k: 0 * v for k, v in gen.timing.items()}
        torch.manual_seed(0)
        gen.generate(prompts, on, sampling)
        out.append(round(1000 * gen.timing["decode_s"] / gen.timing["decode_steps"], 3))
    return out


def sampler_ends(model, tok) -> dict:
    prompts, on, res = speed._prompts(tok, 32, 512, seed=32), [True] * 32, {}
    handles = ds.handles
    try:
        for name, sampler, ends in [
            ("Triton sampler, compiled ends", True, True),
            ("Triton sampler, eager ends", True, False),
            ("torch sampler, compiled ends", False, True),
            ("torch sampler, eager ends", False, False),
        ]:
            ds.handles = handles if sampler else (lambda *a: False)
            torch._dynamo.reset()
            res[name] = {"ms_per_step": _decode_ms(FastGenerator(model, tok, compile_ends=ends), prompts, on)}
            print(name, res[name], flush=True)
    finally:
        ds.handles = handles
    return res


def two_sets(model, tok) -> dict:
    prompts, on, res, outs = speed._prompts(tok, 32, 512, seed=32), [True, False] * 16, {}, []
    together = FastGenerator._decode

    def one_by_one(self, batches):
        for b in batches:
            together(self, [b])

    gen = FastGenerator(model, tok)
    try:
        for name, decode in [("one by one", one_by_one), ("together", together)]:
            FastGenerator._decode = decode
            gen.generate(prompts, on, TURN)
            walls = []
            for _ in range(3):
                torch.manual_seed(0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs.append(gen.generate(prompts, on, TURN))
                torch.cuda.synchronize()
                walls.append(round(time.perf_counter() - t0, 3))
            res[name] = {"turn_s": walls}
            print(name, res[name], flush=True)
    finally:
        FastGenerator._decode = together
    res["same_tokens"] = all(o == outs[0] for o in outs)
    return res


def attention_splits(model, tok) -> dict:
    prompts, on, res = speed._prompts(tok, 32, 512, seed=32), [True] * 32, {}
    kept = da.PROGRAMS_PER_SM
    try:
        for per_sm in (1, 2, 4, 8):
            da.PROGRAMS_PER_SM = per_sm
            res[f"{per_sm} per SM"] = {"ms_per_step": _decode_ms(FastGenerator(model, tok), prompts, on)}
            print(per_sm, res[f"{per_sm} per SM"], flush=True)
    finally:
        da.PROGRAMS_PER_SM = kept
    return res


def cohort_lora(model, tok) -> dict:
    """What a cohort of S seeds in one process would pay for a decode step's projections (the cohort lever).

    One decode step's weight products (28 layers of q/k/v, o, gate/up, down, and the LM head), CUDA-graphed,
    on the Qwen2.5-1.5B shapes with random bf16 weights, timed three ways for S seeds of 32 rows each:
    - today: each seed's own folded weights, S batches of 32 one after the other (S weight reads);
    - one folded set at S·32 rows (the ideal: one weight read; no adapters);
    - the cohort: the base weights at S·32 rows plus each seed's LoRA (r = 32) on its own rows, two
      batched products a projection group (q/k/v share A's input, gate/up too): one weight read plus
      S adapters.
    Attention and norms are not in it: the decode section's batch-96 step has them for one weight set.
    """
    res = {}
    for seeds in (2, 3):
        res.update(_cohort_case(seeds))
        torch.cuda.empty_cache()
    return res


def _cohort_case(seeds: int, rows: int = 32) -> dict:
    d, qkv, inter, vocab, layers, r = 1536, 2048, 8960, 151936, 28, 32
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seeds)

    def w(*shape):
        return (torch.randn(*shape, device=dev, generator=g) * 0.02).to(dt)

    sets = [[(w(qkv, d), w(d, d), w(2 * inter, d), w(d, inter)) for _ in range(layers)] for _ in range(seeds)]
    head = w(vocab, d)
    # per layer: (A_qkv, B_qkv, A_o, B_o, A_gu, B_gu, A_down, B_down), one seed per batch entry
    lora = [
        (w(seeds, d, 3 * r), w(seeds, 3 * r, qkv), w(seeds, d, r), w(seeds, r, d))
        + (w(seeds, d, 2 * r), w(seeds, 2 * r, 2 * inter), w(seeds, inter, r), w(seeds, r, d))
        for _ in range(layers)
    ]
    x_small, x_big = w(rows, d), w(seeds * rows, d)
    h_small, h_big = w(rows, inter), w(seeds * rows, inter)

    def projections(x, h, weights, adapters=None):
        out = []
        for i, (wqkv, wo, wgu, wdown) in enumerate(weights):
            ys = [x @ wqkv.T, x @ wo.T, x @ wgu.T, h @ wdown.T]
            if adapters is not None:
                aq, bq, ao, bo, agu, bgu, ad, bd = adapters[i]
                xs, hs = x.view(seeds, rows, d), h.view(seeds, rows, inter)
                for y, a, b, inp in ((0, aq, bq, xs), (1, ao, bo, xs), (2, agu, bgu, xs), (3, ad, bd, hs)):
                    ys[y] = ys[y].view(seeds, rows, -1).baddbmm(torch.bmm(inp, a), b).view(seeds * rows, -1)
            out.append(sum(y[:, :1].sum() for y in ys))
        return torch.stack(out).sum() + (x @ head.T)[:, :1].sum()

    variants = {
        f"today: {seeds} folded sets × {rows} rows, one after the other": lambda: sum(
            projections(x_small, h_small, ws) for ws in sets
        ),
        f"one folded set × {seeds * rows} rows (no adapters: the ideal)": lambda: projections(x_big, h_big, sets[0]),
        f"cohort: base × {seeds * rows} rows + {seeds} per-row LoRAs": lambda: projections(
            x_big, h_big, sets[0], lora
        ),
    }
    res = {}
    for name, fn in variants.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 20)
        res[f"S={seeds}: {name}"] = {"ms_per_step": round(sorted(times)[2], 3)}
        print(name, res[f"S={seeds}: {name}"], flush=True)
    return res


def cohort_decode(model, tok) -> dict:
    """A seed cohort's turn through the engine: three adapters' 32 rows each (512-token prompts, 256 new
    tokens), as one batch per adapter's merged copy on its own stream, and as one stacked batch over the
    base weights; beside one adapter's 32 rows (a lone run's turn) and 96 rows of one merged copy (the
    ideal: one weight read, no per-row LoRA). Prefill and decode seconds of a turn, medians of three."""
    names = [True] + [speed.add_adapter(model, f"seed{k}", 32, k, 0.01) for k in (1, 2)]
    cases = [
        ("one adapter, 32 rows", [True] * 32, False),
        ("one adapter, 96 rows", [True] * 96, False),
        ("3 adapters x 32 rows, a batch each (streams)", [n for n in names for _ in range(32)], False),
        ("3 adapters x 32 rows, stacked", [n for n in names for _ in range(32)], True),
    ]
    prompts, res = speed._prompts(tok, 96, 512, seed=96), {}
    for name, on, stack in cases:
        gen = FastGenerator(model, tok, stack_adapters=stack)
        gen.generate(prompts[: len(on)], on, TURN)  # compile and capture
        split = {"prefill_s": [], "decode_s": []}
        for _ in range(3):
            gen.timing = {k: 0 * v for k, v in gen.timing.items()}
            torch.manual_seed(0)
            gen.generate(prompts[: len(on)], on, TURN)
            for k in split:
                split[k].append(gen.timing[k])
        res[name] = {k: round(sorted(v)[1], 3) for k, v in split.items()}
        res[name]["ms_per_step"] = round(1000 * res[name]["decode_s"] / (TURN.max_new_tokens - 1), 3)
        print(name, res[name], flush=True)
        del gen
        torch.cuda.empty_cache()
    return res


def eval_sampler(model, tok) -> dict:
    """Eval's sampling (T 0.7, top-k 20, top-p 0.8): the sampler alone and a decode step, kernels against torch."""
    ev = Sampling(max_new_tokens=256, **speed.EVAL_SAMPLING)
    res, handles_top = {}, ds.handles_top
    vocab = model.config.vocab_size
    for rows in (32, 640):
        logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16)
        u = torch.rand(rows, device="cuda")
        for name, fn in [("kernels", ds.sample_top_with_logprob), ("torch", speed.sample_with_logprob)]:
            fn(logits, ev.temperature, ev.top_k, ev.top_p, u)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                fn(logits, ev.temperature, ev.top_k, ev.top_p, u)
            end.record()
            torch.cuda.synchronize()
            res[f"sampler alone, batch {rows}, {name}"] = {"ms": round(start.elapsed_time(end) / 100, 4)}
            print(f"sampler alone, batch {rows}, {name}", res[f"sampler alone, batch {rows}, {name}"], flush=True)
    try:
        for rows in (32, 600):
            prompts, on = speed._prompts(tok, rows, 512, seed=rows), [True] * rows
            for name, on_off in (("kernels", True), ("torch", False)):
                ds.handles_top = handles_top if on_off else (lambda *a: False)
                key = f"decode step, batch {rows}, {name}"
                res[key] = {"ms_per_step": _decode_ms(FastGenerator(model, tok), prompts, on, 2, ev)}
                print(key, res[key], flush=True)
    finally:
        ds.handles_top = handles_top
    return res


EXPERIMENTS = {
    "eval-sampler": eval_sampler,
    "sampler-ends": sampler_ends,
    "two-sets": two_sets,
    "attention-splits": attention_splits,
    "cohort-lora": cohort_lora,
    "cohort-decode": cohort_decode,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    ap.add_argument("--out", default="results/ab")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/ab.py measures CUDA graphs and streams: it needs a CUDA GPU")
    logging.basicConfig(level=logging.WARNING)
    spec = ModelSpec("random:qwen2.5-1.5b")
    tok = load_tokenizer(spec)
    model = speed._peft(load_model(spec, torch.bfloat16, torch.device("cuda")), r=32, b_scale=0.01)
    res = {
        "experiment": args.experiment,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        **EXPERIMENTS[args.experiment](model, tok),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.experiment}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
