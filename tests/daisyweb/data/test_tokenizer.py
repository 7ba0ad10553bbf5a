import hashlib
import json
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import daisyweb.data as data
from daisyweb.data import (
    PATTERN,
    Tokenizer,
    TokenizerError,
    builtin_text,
    builtin_tokens,
    default_tokenizer,
    train_bpe,
)
from daisyweb.data.corpus import full_corpus_text
from daisyweb.data.tokenizer import CACHE_WORDS, MAX_WORD

VOCAB_FILE = Path(data.__file__).resolve().parent / "tokenizer.json"
# Pinned: checkpoints carry (vocab_size, file_hash). Changing the committed file must be
# a deliberate act that updates these two lines.
PINNED_VOCAB = 2048
PINNED_SHA256 = "b57a22c98ea255f10dd5656e3c8f4577ee882924f133fa01221fccd8bef27cd7"


# -- the shipped file -------------------------------------------------------------------


def test_shipped_vocab_size_and_hash_are_pinned():
    tok = default_tokenizer()
    assert tok.vocab_size == PINNED_VOCAB == 256 + len(tok.merges)
    assert tok.file_hash == hashlib.sha256(VOCAB_FILE.read_bytes()).hexdigest()
    assert tok.file_hash == PINNED_SHA256
    assert tok.meta["special_tokens"] == {}


def test_default_tokenizer_is_cached_and_equals_a_fresh_load():
    assert default_tokenizer() is default_tokenizer()
    fresh = Tokenizer.from_file(VOCAB_FILE)
    assert fresh.merges == default_tokenizer().merges
    assert fresh.file_hash == default_tokenizer().file_hash


def test_to_json_reproduces_the_committed_file():
    # the file is what the training script writes: regenerate it from the parsed merges
    tok = default_tokenizer()
    meta = {k: tok.meta[k] for k in ("trained_on", "trained_bytes", "corpus_sha256",
                                      "special_tokens")}
    assert tok.to_json(**meta) == VOCAB_FILE.read_text(encoding="utf-8")


# -- round trips ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=3_900_000), st.integers(min_value=1, max_value=3000))
def test_round_trip_on_corpus_slices(start, length):
    text = builtin_text()[start : start + length]
    ids = default_tokenizer().encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert default_tokenizer().decode(ids) == text


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_on_arbitrary_unicode(text):
    tok = default_tokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ids.size <= len(text.encode("utf-8"))  # merges never lengthen
    if ids.size:
        assert 0 <= ids.min() and ids.max() < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text  # lists are accepted too


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_pretokenisation_is_lossless(text):
    assert "".join(re.findall(PATTERN, text)) == text


def test_pretokenisation_is_gpt2_like():
    words = re.findall(PATTERN, "Hello world, it's 42 dogs' _x  \n\nend")
    # as GPT-2: a space sticks to the next word; trailing whitespace leaves one char behind
    assert words == ["Hello", " world", ",", " it", "'s", " 42", " dogs", "'", " _", "x",
                     "  \n", "\n", "end"]


def _naive_encode(tok: Tokenizer, text: str) -> list[int]:
    # reference: apply every merge in training order to each pre-token, no ranks, no cache
    out: list[int] = []
    words = [w[k : k + MAX_WORD] for w in re.findall(PATTERN, text)
             for k in range(0, len(w), MAX_WORD)]
    for word in words:
        ids = list(word.encode("utf-8"))
        for new, (a, b) in enumerate(tok.merges, start=256):
            i, merged = 0, []
            while i < len(ids):
                if i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(ids[i])
                    i += 1
            ids = merged
        out += ids
    return out


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=4_000_000))
def test_fast_encode_equals_sequential_merges(start):
    tok = default_tokenizer()
    text = builtin_text()[start : start + 200] + " naïve café, 3.14159 — 'quoted'"
    assert tok.encode(text).tolist() == _naive_encode(tok, text)


def test_long_words_are_chunked_so_hostile_text_stays_fast():
    tok = Tokenizer(default_tokenizer().merges)  # empty cache
    # real words with the spaces taken out: unchunked BPE on one such word takes about
    # 1 s for 20k characters and grows quadratically
    despaced = re.sub(r"[^A-Za-z]", "", builtin_text()[:300_000])[:200_000]
    for hostile in (despaced, " " * 200_000, "7" * 200_000, "é" * 50_000):
        t0 = time.perf_counter()
        ids = tok.encode(hostile)
        assert time.perf_counter() - t0 < 5
        assert tok.decode(ids) == hostile
    assert len(tok._cache) < 100  # long words are not cached: memory stays bounded
    long_word = "x" * (MAX_WORD + 10)
    assert tok.encode(long_word).tolist() == _naive_encode(tok, long_word)


def test_cache_is_bounded():
    tok = Tokenizer(default_tokenizer().merges)
    # CACHE_WORDS + 1000 distinct four-letter words (base-26 numerals)
    words = ("".join(chr(97 + i // 26**k % 26) for k in range(4))
             for i in range(CACHE_WORDS + 1000))
    tok.encode(" ".join(words))
    assert len(tok._cache) == CACHE_WORDS


def test_encode_cache_gives_same_ids_and_rejects_non_text():
    tok = Tokenizer.from_file(VOCAB_FILE)
    first = tok.encode("And God said, Let there be light")
    assert tok.encode("And God said, Let there be light").tolist() == first.tolist()
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_decode_refuses_out_of_range_ids_and_replaces_bad_utf8():
    tok = default_tokenizer()
    with pytest.raises(TokenizerError, match="outside 0..2047"):
        tok.decode([1, 2048])
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode(np.array([-1], dtype=np.int32))
    with pytest.raises(TokenizerError):
        tok.decode(np.zeros((2, 2), dtype=np.int32))
    assert tok.decode([]) == ""
    assert tok.decode([0xC3]) == "\ufffd"  # half a UTF-8 sequence decodes with replacement
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffd\ufffd\ufffdb"  # lone surrogate


def test_whole_corpus_compression_and_speed():
    tok = Tokenizer.from_file(VOCAB_FILE)  # fresh cache: measure a cold encode
    text = builtin_text()
    t0 = time.perf_counter()
    ids = tok.encode(text)
    seconds = time.perf_counter() - t0
    ratio = len(text.encode("utf-8")) / ids.size
    print(f"\nbuilt-in corpus: {ids.size} tokens, {ratio:.2f} bytes/token, "
          f"encoded in {seconds:.2f} s")
    assert ratio > 2.5
    assert seconds < 20  # about 1 s on one idle core; generous for a shared machine
    assert np.array_equal(ids, builtin_tokens())


# -- refused files ------------------------------------------------------------------------


def _good() -> dict:
    return json.loads(VOCAB_FILE.read_text(encoding="utf-8"))


def _write(tmp_path: Path, content: str | bytes) -> Path:
    p = tmp_path / "tok.json"
    if isinstance(content, str):
        p.write_text(content, encoding="utf-8")
    else:
        p.write_bytes(content)
    return p


def test_good_copy_loads(tmp_path):
    tok = Tokenizer.from_file(_write(tmp_path, json.dumps(_good())))
    assert tok.merges == default_tokenizer().merges


def test_truncated_file_is_refused(tmp_path):
    raw = VOCAB_FILE.read_bytes()
    for cut in (0, 10, len(raw) // 2, len(raw) - 3):
        with pytest.raises(TokenizerError, match="not valid JSON"):
            Tokenizer.from_file(_write(tmp_path, raw[:cut]))


def test_garbage_and_wrong_shapes_are_refused(tmp_path):
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_file(_write(tmp_path, b"\xff\xfe\x00garbage"))
    with pytest.raises(TokenizerError, match="JSON object"):
        Tokenizer.from_file(_write(tmp_path, "[1, 2]"))
    with pytest.raises(TokenizerError, match="cannot be read"):
        Tokenizer.from_file(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="gpt2"), "format"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.pop("pattern"), "pattern"),
        (lambda d: d.update(pattern=r"\w+"), "supported pre-tokenisation"),
        (lambda d: d.update(merges={"a": 1}), "list"),
        (lambda d: d["merges"].__setitem__(5, [1]), "merge 5"),
        (lambda d: d["merges"].__setitem__(5, [1.0, 2]), "merge 5"),
        (lambda d: d["merges"].__setitem__(5, [True, 2]), "merge 5"),
        (lambda d: d["merges"].__setitem__(0, [256, 1]), "not defined before"),
        (lambda d: d["merges"].__setitem__(3, [-1, 1]), "not defined before"),
        (lambda d: d["merges"].__setitem__(9, d["merges"][2]), "repeats"),
        (lambda d: d["merges"].pop(), "vocab_size"),
        (lambda d: d.update(vocab_size=4096), "vocab_size"),
    ],
)
def test_corrupted_contents_are_refused(tmp_path, edit, message):
    d = _good()
    edit(d)
    path = _write(tmp_path, json.dumps(d))
    with pytest.raises(TokenizerError, match=message) as err:
        Tokenizer.from_file(path)
    assert str(path) in str(err.value)  # the message names the file


def test_tokenizer_error_is_a_value_error():
    assert issubclass(TokenizerError, ValueError)


# -- training -----------------------------------------------------------------------------


def _naive_train(text: str, vocab: int) -> list[tuple[int, int]]:
    # reference trainer: recount every pair each round; ties go to the smallest pair
    words = Counter(w[k : k + MAX_WORD] for w in re.findall(PATTERN, text)
                    for k in range(0, len(w), MAX_WORD))
    seqs = {w: list(w.encode("utf-8")) for w in words}
    merges = []
    while len(merges) < vocab - 256:
        counts: Counter = Counter()
        for w, ids in seqs.items():
            for p in zip(ids, ids[1:], strict=False):
                counts[p] += words[w]
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        new = 256 + len(merges)
        merges.append(best)
        for w, ids in seqs.items():
            i, out = 0, []
            while i < len(ids):
                if i + 1 < len(ids) and (ids[i], ids[i + 1]) == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            seqs[w] = out
    return merges


def test_incremental_trainer_matches_naive_reference():
    text = (builtin_text()[100_000:130_000] + " aaaa aaa aa banana bandana ünïcödé "
            + "abc" * 200)  # one word longer than MAX_WORD
    assert train_bpe(text, 256 + 120) == _naive_train(text, 256 + 120)


def test_trainer_is_deterministic_and_stops_when_nothing_is_left():
    text = "abab abab cd"
    merges = train_bpe(text, 300)
    assert merges == train_bpe(text, 300)
    # ab, abab, ' c', ' abab', ' cd': then every word is one token and training stops
    assert merges == [(97, 98), (256, 256), (32, 99), (32, 257), (258, 100)]
    tok = Tokenizer(merges)
    assert len(tok.encode("abab")) == 1 and tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe(text, 100)


def test_shipped_merges_are_what_training_on_the_corpus_gives():
    # the committed file is reproducible from the committed corpus (about 1-2 s): the
    # whole file, held-out part included (the tokenizer saw it; no model trains on it)
    assert train_bpe(full_corpus_text(), PINNED_VOCAB) == default_tokenizer().merges
    assert default_tokenizer().meta["corpus_sha256"] == hashlib.sha256(
        full_corpus_text().encode("utf-8")).hexdigest()
