"""dolma2 tokenizer vs tiktoken's own cl100k_base, built independently from the same published file,
and documents as AI2's `dolma tokens` writes them (tests/fixtures/dolma2_reference.json)."""
import gzip
import hashlib
import itertools
import json
import os

import numpy as np
import pytest
import tiktoken

import data
from data import corpus, tokenizer
from data.prepare import _encode_chunk, encode_documents

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """tiktoken's cl100k_base, constructed by tiktoken_ext itself (its own regex, specials and hash
    check); the ranks come from a pre-seeded tiktoken cache since these machines are offline."""
    import bpe_openai
    import os

    cache = tmp_path_factory.mktemp("tiktoken-cache")
    wheel_file = os.path.join(os.path.dirname(bpe_openai.__file__), "data", "cl100k_base.tiktoken.gz")
    with gzip.open(wheel_file, "rb") as f:
        (cache / hashlib.sha1(CL100K_URL.encode()).hexdigest()).write_bytes(f.read())
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        from tiktoken_ext import openai_public

        return tiktoken.Encoding(**openai_public.cl100k_base())
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def texts():
    """A spread of the embedded corpus: every 25th stdlib file, every 4th pydoc topic, and edge cases."""
    docs = list(corpus.stdlib_documents())
    code = [d.text for d in docs if d.domain == "code"][::25]
    prose = [d.text for d in docs if d.domain == "docs"][::4]
    edge = ["", " ", "\n\n\n", "héllo wörld 你好 🙂", "x = 1  \r\n\ty = 2", "it's we'll they're I'M", "12345678901",
            "<|endoftext|> is text here"]
    return code + prose + edge


def test_constants_and_specials():
    enc = data.dolma2()
    assert (data.EOS_ID, data.PAD_ID, data.VOCAB_SIZE) == (100257, 100277, 100278)
    assert enc.n_vocab == data.VOCAB_SIZE and enc.eot_token == data.EOS_ID
    assert enc.encode("<|endoftext|>", allowed_special="all") == [data.EOS_ID]
    assert enc.encode("<|pad|>", allowed_special="all") == [data.PAD_ID]
    assert enc.decode([data.PAD_ID]) == "<|pad|>"


def test_agrees_with_cl100k_reference(reference, texts):
    enc = data.dolma2()
    assert sum(len(t) for t in texts) > 1_000_000
    for t in texts:
        assert enc.encode_ordinary(t) == reference.encode_ordinary(t)
    # The parallel corpus encoder (numpy path, text stripped as `dolma tokens` does, eos appended).
    tokens, lengths = _encode_chunk(texts)
    want = list(itertools.chain.from_iterable(reference.encode_ordinary(t.strip()) + [data.EOS_ID] for t in texts))
    np.testing.assert_array_equal(tokens, np.array(want, dtype=np.uint32))
    assert lengths.tolist() == [len(reference.encode_ordinary(t.strip())) + 1 for t in texts]
    # cl100k's ids are unchanged; dolma2 fills its unused ids below 100276 with added tokens and puts <|pad|> last.
    assert reference.n_vocab == data.VOCAB_SIZE - 1


def test_round_trip(texts):
    enc = data.dolma2()
    for t in texts:
        assert enc.decode(enc.encode_ordinary(t)) == t


def test_refuses_a_corrupt_ranks_file(tmp_path, monkeypatch):
    bad = tmp_path / "cl100k_base.tiktoken.gz"
    with gzip.open(tokenizer.cl100k_path(), "rb") as f:
        raw = bytearray(f.read())
    raw[100] ^= 1
    with gzip.open(bad, "wb") as f:
        f.write(bytes(raw))
    monkeypatch.setattr(tokenizer, "cl100k_path", lambda: str(bad))
    tokenizer.dolma2.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="sha256"):
            tokenizer.dolma2()
    finally:
        monkeypatch.undo()
        tokenizer.dolma2.cache_clear()


def test_documents_equal_dolma_tokens():
    """Every case of the fixture (AI2's dolma 1.2.1 `tokenize_file` with the dolma2 tokenizer.json and
    the OLMo 3 settings, see its "about") through data.prepare's encoder: stripped text, blank
    documents skipped, Dolma's PII masks and <|extra_id_N|> as one token each, special-token
    strings as text, one eos. Whitespace runs, trailing newlines, digits, contractions, emoji."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", "dolma2_reference.json")
    cases = json.load(open(path, encoding="utf-8"))["cases"]
    docs = [corpus.Document(f"case{i}", c["text"], "test") for i, c in enumerate(cases)]
    got = {}
    for chunk, tokens, lengths in encode_documents(docs, workers=1):
        ends = np.cumsum(lengths)
        for d, end, n in zip(chunk, ends, lengths):
            got[d.name] = tokens[end - n:end].tolist()
    assert sum(c["ids"] is None for c in cases) >= 3 and sum("|||" in c["text"] for c in cases) >= 2
    for i, c in enumerate(cases):
        assert got.get(f"case{i}") == c["ids"], (i, c["text"][:60])
    # the same ids through data.tokenizer.encode (evaluation requests, chat content), without the eos
    for c in cases:
        if c["ids"] is not None:
            assert tokenizer.encode(c["text"].strip()) == c["ids"][:-1]


def test_cl100k_specials_keep_their_ids_and_chat_content_keeps_tool_markers_as_text(reference):
    """cl100k_base's own special tokens (tiktoken_ext's table) are dolma2's at the same ids. In chat
    content (encode_chat_text) "<|extra_id_1..4|>", the chat tokenizer's tool markers, are plain
    text; every other in-text added token is one token there as in documents (encode)."""
    enc = data.dolma2()
    assert len(reference.special_tokens_set) == 5
    for s in reference.special_tokens_set:
        (i,) = reference.encode(s, allowed_special="all")
        assert tokenizer.ADDED_TOKENS[s] == i and enc.encode(s, allowed_special="all") == [i], s
    for s in sorted(tokenizer.IN_TEXT):
        text = f"a {s} b"
        as_token = reference.encode_ordinary("a ") + [tokenizer.ADDED_TOKENS[s]] + reference.encode_ordinary(" b")
        assert tokenizer.encode(text) == as_token == tokenizer.encode_to_numpy(text).tolist(), s
        marker = s in {f"<|extra_id_{i}|>" for i in range(1, 5)}
        assert tokenizer.encode_chat_text(text) == (reference.encode_ordinary(text) if marker else as_token), s
