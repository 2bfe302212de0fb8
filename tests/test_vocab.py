"""The compact Qwen tokenizer segments its corpus as full Qwen does and round-trips any text."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from talkmethods.models import QWEN_SPECIAL_TOKENS
from talkmethods.vocab import bpe_pieces, compact_qwen_tokenizer, compact_ranks, qwen_ranks, words

MESSAGES = [
    {"role": "system", "content": "You are Ava. You and Ben each know part of a problem."},
    {"role": "user", "content": "Ava has 4 apples. How many apples are there?"},
    {"role": "assistant", "content": "She gets 5 more apples, so 4 + 5 = 9. \\boxed{9}"},
]
SENTENCES = [
    "Ava has 4 apples.",
    "She gets 5 more apples.",
    "4 + 5 = 9. 9 - 3 = 6. \\boxed{6}",
    "Zorblax keeps them in 12 jars.\n\nQuimby found 29 pebbles near 5 rivers!",
    "  indented\ttext with 'quotes' and it's fine\r\n",
]


@pytest.fixture(scope="module")
def corpus(qwen_tokenizer) -> list[str]:
    return [*SENTENCES, qwen_tokenizer.apply_chat_template(MESSAGES, tokenize=False)]


@pytest.fixture(scope="module")
def compact(corpus):
    return compact_qwen_tokenizer(corpus)


def token_strings(tok, text: str) -> list[str]:
    return tok.convert_ids_to_tokens(tok(text)["input_ids"])


def test_corpus_segments_as_full_qwen(compact, corpus, qwen_tokenizer):
    for text in corpus:
        assert token_strings(compact, text) == token_strings(qwen_tokenizer, text), text


def test_special_tokens_are_single_tokens_after_the_bpe_ids(compact, corpus):
    n = len(compact) - len(QWEN_SPECIAL_TOKENS)
    assert compact.convert_ids_to_tokens([n, n + 1, n + 2]) == QWEN_SPECIAL_TOKENS
    assert (compact.pad_token_id, compact.eos_token_id) == (n, n + 2)
    chat = compact.apply_chat_template(MESSAGES, tokenize=False)
    assert chat == corpus[-1]  # the same template renders the same text
    pieces = token_strings(compact, chat)
    assert pieces.count("<|im_start|>") == pieces.count("<|im_end|>") == len(MESSAGES)
    assert compact.padding_side == "left"


def test_vocabulary_is_compact_and_holds_every_byte(compact):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert len(compact) < 256 + 3 + 200  # bytes, specials, and the pieces (with their merge paths) of a few sentences
    vocab = compact.get_vocab()
    assert len(vocab) == len(compact)
    assert set(bytes_to_unicode().values()) <= set(vocab)  # byte-level spellings of all 256 bytes
    ranks = compact_ranks(SENTENCES)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(bytes([b]) in ranks for b in range(256))


def test_ranks_keep_qwen_order():
    full = qwen_ranks()
    ranks = compact_ranks(SENTENCES)
    assert sorted(ranks, key=ranks.__getitem__) == sorted(ranks, key=full.__getitem__)


def test_same_corpus_same_ids(corpus):
    first, second = compact_qwen_tokenizer(corpus), compact_qwen_tokenizer(reversed(corpus + corpus))
    assert first.get_vocab() == second.get_vocab()
    assert first(corpus)["input_ids"] == second(corpus)["input_ids"]


def test_bpe_pieces_match_full_qwen(qwen_tokenizer):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = qwen_ranks()
    for word in words("Quimby found 29 pebbles near the rivers, didn't he? 漢字 😀"):
        full = token_strings(qwen_tokenizer, word.decode())
        assert bpe_pieces(word, ranks) == [bytes(to_byte[char] for char in piece) for piece in full]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_any_text_round_trips(compact, text):
    assert compact.decode(compact(text, add_special_tokens=False)["input_ids"]) == text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(max_size=40), min_size=1, max_size=4))
def test_any_corpus_segments_as_full_qwen(qwen_tokenizer, texts):
    tok = compact_qwen_tokenizer(texts)
    for text in texts:
        assert token_strings(tok, text) == token_strings(qwen_tokenizer, text)


def test_a_saved_model_dir_reloads_the_same_segmentation(compact, corpus, qwen_tokenizer, tmp_path):
    """``AutoTokenizer`` on a Qwen2 model dir rebuilds the tokenizer as ``Qwen2Tokenizer`` from vocab and
    merges, without ``ignore_merges``: every whole-word token must still be reachable by merges."""
    from transformers import AutoTokenizer, Qwen2Config

    compact.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(compact)).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in corpus:
        assert token_strings(loaded, text) == token_strings(qwen_tokenizer, text), text
