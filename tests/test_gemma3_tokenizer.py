"""Gemma's sentencepiece vocabulary (tokenizer.ggml.model = llama in a gemma3 GGUF) against transformers' own
GemmaTokenizer built from the same GGUF (its GGUF loader): ids and decoded text on unicode, digits, runs of
spaces, control and user-defined tokens, unknown characters through the <0xXX> byte tokens, on a tiny vocabulary
whose scores disagree with its order (Gemma's merges follow the order). The published 270M file's 262,144 entries:
tests/test_gemma3_real.py. Needs the interop extra (transformers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import transformers

from model.gguf import write_gguf
from model.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, build_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

SPECIALS = [("<pad>", TOKEN_CONTROL), ("<eos>", TOKEN_CONTROL), ("<bos>", TOKEN_CONTROL), ("<unk>", TOKEN_CONTROL)]
SPECIALS += [("<mask>", TOKEN_CONTROL), ("[multimodal]", TOKEN_USER_DEFINED)]
SPECIALS += [("<start_of_turn>", TOKEN_CONTROL), ("<end_of_turn>", TOKEN_CONTROL), ("\n", TOKEN_USER_DEFINED)]
SPECIALS += [("\n\n", TOKEN_USER_DEFINED), ("  ", TOKEN_USER_DEFINED), ("   ", TOKEN_USER_DEFINED)]
BYTES = [(f"<0x{b:02X}>", TOKEN_BYTE) for b in range(256)]
# pieces in merge order; "bc" before "ab" (so "abc" is a + bc), though "ab" scores higher below
PIECES = "▁ a b c d e h l o r t w 1 2 3 é 世 bc ab ▁t he ▁the ll llo el hel hello ▁w or ▁wor ld ▁world 12 123 ▁é"
TEXTS = [
    "hello world",
    "the abc",
    "  the   world    ",
    "abc\n\nhello\nthe",
    "hé 世界 🤗 é",
    "123 1234 12 3",
    "<start_of_turn>user\nhello<end_of_turn>\n",
    "x<bos>y<eos>[multimodal]",
    "\t tab \u00a0nbsp",
    "",
    " ",
]


def _metadata() -> dict[str, object]:
    entries = SPECIALS + BYTES + [(p, TOKEN_NORMAL) for p in PIECES.split(" ")]
    tokens = [t for t, _ in entries]
    rng = np.random.default_rng(0)
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": rng.permutation(len(tokens)).astype(np.float32) * -1.0,  # not the merge order
        "tokenizer.ggml.token_type": np.array([ty for _, ty in entries], np.int32),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch) -> tuple:
    folder = tmp_path_factory.mktemp("gemma_tok")
    meta = _metadata()
    write_gguf(folder / "tok.gguf", "gemma3", meta, [])
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="tok.gguf")
    return build_tokenizer(meta), theirs


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_transformers(pair: tuple, text: str) -> None:
    ours, theirs = pair
    want = theirs(text, add_special_tokens=False).input_ids
    got = ours.encode(text, add_bos=False)
    assert got == want, (got, [ours.id_to_token(i) for i in got], [ours.id_to_token(i) for i in want])
    assert ours.decode(got) == theirs.decode(want)
    assert ours.encode(text) == theirs(text).input_ids  # with <bos>, as tokenizer.ggml.add_bos_token says


def test_the_pieces_that_matter(pair: tuple) -> None:
    """Merge order by position (a + bc), a run of spaces through its U+2581 spelling (the stored "  " is
    user-defined but never matched as typed), byte fallback, control tokens whole."""
    ours, _ = pair
    tokens = ours.tokens

    def pieces(text: str) -> list[str]:
        return [tokens[i] for i in ours.encode(text, add_bos=False)]

    assert pieces("abc") == ["a", "bc"]
    assert pieces("the  world") == ["t", "he", "  ", "w", "or", "ld"]  # "▁▁" is id of "  " (respelled)
    assert pieces("🤗") == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x97>"]
    assert pieces("<end_of_turn>x") == ["<end_of_turn>", "<0x78>"]
    assert ours.decode(ours.encode("hé 🤗  x")) == "<bos>hé 🤗  x"


def test_other_sentencepiece_vocabularies_stay_refused() -> None:
    meta = {**_metadata(), "general.architecture": "llama"}
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='llama' is not supported.*gemma3"):
        build_tokenizer(meta)


def test_written_file_round_trip(tmp_path: Path) -> None:
    """load_tokenizer on a written GGUF is build_tokenizer of its metadata."""
    from model.tokenizer import load_tokenizer

    meta = _metadata()
    write_gguf(tmp_path / "t.gguf", "gemma3", meta, [])
    text = "hello the world 123 é"
    assert load_tokenizer(tmp_path / "t.gguf").encode(text) == build_tokenizer(meta).encode(text)
