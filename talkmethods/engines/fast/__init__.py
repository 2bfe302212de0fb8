"""The fast rollout engine: merged weights, a static KV cache, one CUDA graph per decode step.

What makes it fast (DESIGN §4), in the order it matters on a GPU:

* **Merged weights.** Seat turns run on an inference copy of the weights with the LoRA product
  folded in (``W + s·B·A``, q/k/v and gate/up fused into one matrix each). ``sync_weights`` rewrites
  that copy in place after every optimizer step, so captured graphs see the new policy. Base-seat
  turns (mixed partners, base evals) run on a second fused copy without the adapter; PEFT's
  per-row adapter routing and ``disable_adapter`` are never on the hot path.
* **Several adapters, one batch** (a seed cohort: each seed its own adapter in one model). Every
  adapter has its merged copy; a call whose rows name several adapters prefills each adapter's rows
  on its copy and decodes them as one batch over the base weights (``weights.StackedWeights``): one
  product per projection reads the base matrix once for all rows, with every adapter's ``A`` stacked
  below it, and one batched product adds each row group's ``B``. Three adapters' 32 rows on an H100:
  3.62 ms a decode step, against 6.74 for three runs' batches of 32 and 2.90 for one merged set at 96
  rows (``bench/ab.py cohort-decode``).
* **Static KV cache, one CUDA graph per step.** The cache is allocated once per batch size; a
  decode step (embed → 28 layers → sampling → cache write → stop flags) is captured as one CUDA
  graph, so a step is one ``replay()`` with no host work. One layer function is ``torch.compile``'d
  and serves all 28 layers (seconds to compile, not minutes). Attention reads only the first ``S``
  columns of the cache, ``S`` the turn's prompt width plus ``max_new_tokens`` rounded up to 256, so
  short turns do not pay for the longest one. Its form (``attention="auto"``): on a GPU one Triton
  split-KV kernel that also writes the token's K/V and reads only the columns in use
  (``attention``; on an H200 2.35 against 2.81 ms a step at batch 32 for cuDNN's fused SDPA,
  8.9 against 11.7 ms at batch 600); elsewhere one fused SDPA kernel up to batch 256, two products above.
* **Both weight sets at once.** A call with adapter and base rows (mixed partners' B turns) runs
  one batch per set, decoded together: each replays its graph on its own stream (its own cache,
  split counters, graph pool and capture stream), so at a few rows their kernels overlap (H200:
  a 16 + 16-row turn 0.79 s against 1.05 s one after the other).
* **Sampling on the device** from uniforms drawn once per turn (inverse CDF, top-k before top-p,
  the same rule as ``engines.sampling.pick_token``, searched in 128-token blocks so no full-vocabulary scan
  or sort runs), and the per-token log-prob of every sampled token under ``softmax(logits / T)``:
  the trainer compares it with its own (``train_log.jsonl``: ``logp_diff_max``). Plain sampling
  (the training rollouts: temperature only) is two Triton kernels on a GPU (``sampler``).

On a CPU (tests, the offline default) the same maths runs eagerly, without compile or graphs.

Modules: ``weights`` (the fused copies; a cohort's stacked set), ``qwen2`` (the model maths as functions of tensors),
``generator`` (``FastGenerator``: buffers, lanes, graphs), ``attention`` and ``sampler`` (the Triton
kernels). The package imports none of them itself (so a module here never waits on a half-imported
package); ``engines.ENGINES`` imports ``generator`` only for ``fast``.
"""
