"""A token's raw bytes, from real tokenizers built here: the demo model's byte-level BPE (GPT-2 / Llama 3 style)
and a SentencePiece-style BPE with byte fallback (``<0xNN>`` pieces, Llama 2 / Mistral style). Decoded alone,
every partial-character token reads "\ufffd"; its bytes tell them apart and join back into the text."""

from __future__ import annotations

import pytest

from loraplex.engine.token_bytes import TokenBytes, escape_bytes

TEXTS = ["plain words, and more", "héllo ’quoted’ 😊 日本語 — ok", "\t tabs\nand\\backslashes"]
REPLACEMENT = "\ufffd".encode()


@pytest.fixture(scope="module")
def byte_level(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model["model_dir"])


def byte_fallback_tokenizer(decoder: str):
    """Pieces for a few words, ``<0x00>``..``<0xFF>`` for everything else; "▁" marks a space. ``decoder``: Llama 2's
    (Replace, ByteFallback, Fuse, Strip) or a Metaspace one."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "h", "i", "é", "▁h", "▁hi", "▁é"):
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "i"), ("▁", "é")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    if decoder == "llama2":
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_join_into_the_texts_bytes(byte_level, text):
    token_bytes = TokenBytes(byte_level)
    ids = byte_level.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(i) for i in ids) == text.encode()
    partial = [i for i in ids if byte_level.decode([i]) == "\ufffd"]
    assert bool(partial) == (not text.isascii())  # the tiny vocabulary splits every non-ASCII character
    for i in partial:
        assert token_bytes(i) != REPLACEMENT and token_bytes.escaped(i) == escape_bytes(token_bytes(i))


def test_every_partial_character_token_of_the_vocabulary_is_told_apart(byte_level):
    """All tokens that decode to "\ufffd" alone have different bytes (and names); the 256 one-character tokens
    of the byte alphabet are the 256 bytes; special tokens are their text."""
    token_bytes = TokenBytes(byte_level)
    partial = [i for i in range(len(byte_level)) if byte_level.decode([i]) == "\ufffd"]
    assert len(partial) >= 128  # at least the bytes 0x80..0xFF
    assert len({token_bytes(i) for i in partial}) == len(partial)
    assert len({token_bytes.escaped(i) for i in partial}) == len(partial)
    singles = {token_bytes(byte_level.convert_tokens_to_ids(c)) for c in byte_level.get_vocab() if len(c) == 1
               and byte_level.convert_tokens_to_ids(c) not in byte_level.added_tokens_decoder}
    assert singles == {bytes([b]) for b in range(256)}
    end = byte_level.convert_tokens_to_ids("<|end|>")
    assert token_bytes(end) == b"<|end|>" and token_bytes.escaped(end) is None
    space_e2 = byte_level.convert_tokens_to_ids("â")  # the byte 0xE2: how "’" starts
    assert token_bytes(space_e2) == b"\xe2" and token_bytes.escaped(space_e2) == "\\xe2"


@pytest.mark.parametrize("decoder", ["llama2", "metaspace"])
def test_byte_fallback_pieces_are_their_byte(decoder):
    tok = byte_fallback_tokenizer(decoder)
    token_bytes = TokenBytes(tok)
    ids = tok.encode("hi é😊", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["▁hi", "▁é", "<0xF0>", "<0x9F>", "<0x98>", "<0x8A>"]
    assert [tok.decode([i]) for i in ids[2:]] == ["\ufffd"] * 4  # what a client saw before
    assert [token_bytes(i) for i in ids] == [b" hi", " é".encode(), b"\xf0", b"\x9f", b"\x98", b"\x8a"]
    assert [token_bytes.escaped(i) for i in ids] == [None, None, "\\xf0", "\\x9f", "\\x98", "\\x8a"]
    assert token_bytes(tok.convert_tokens_to_ids("<0x41>")) == b"A"  # a byte piece that is a whole character
    assert token_bytes(tok.convert_tokens_to_ids("</s>")) == b"</s>"


def test_each_id_asks_the_tokenizer_once(byte_level, monkeypatch):
    """Logprobs ask for every sampled token and its alternatives at every step: the answer is kept per id."""
    token_bytes = TokenBytes(byte_level)
    asked: list[int] = []
    lookup = byte_level.convert_ids_to_tokens
    monkeypatch.setattr(byte_level, "convert_ids_to_tokens", lambda i: asked.append(i) or lookup(i))
    ids = byte_level.encode(TEXTS[1], add_special_tokens=False)
    first = [(token_bytes(i), token_bytes.escaped(i)) for i in ids]
    assert [(token_bytes(i), token_bytes.escaped(i)) for i in ids] == first
    assert sorted(asked) == sorted(set(ids))


def test_escaped_bytes_never_collide():
    assert escape_bytes(b" \xe2\x80") == " \\xe2\\x80"
    assert escape_bytes(b"\\xe2") == "\\x5cxe2" != escape_bytes(b"\xe2")  # a literal backslash is escaped too
