"""Tokenizer built from the SmolLM2 GGUF metadata, chat template rendering and the assistant loss mask."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from jinja2.exceptions import SecurityError

from model.chat import check_messages, render_chat, tokenize_chat
from model.tokenizer import GGUFTokenizer, build_tokenizer, load_tokenizer


def _gguf_metadata(path: Path) -> dict[str, Any]:
    """GGUF key/values in model.gguf's shape: str decoded, numeric arrays numpy, string arrays list[str]."""
    out: dict[str, Any] = {}
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] != gguf.GGUFValueType.STRING:
            value = np.asarray(value)
        out[key] = value
    return out


@pytest.fixture(scope="module")
def meta(smollm2_path: Path) -> dict[str, Any]:
    return _gguf_metadata(smollm2_path)


@pytest.fixture(scope="module")
def tok(meta: dict[str, Any]) -> GGUFTokenizer:
    return build_tokenizer(meta)


@pytest.fixture(scope="module")
def template(meta: dict[str, Any]) -> str:
    return meta["tokenizer.chat_template"]


def _id(meta: dict[str, Any], token: str) -> int:
    return meta["tokenizer.ggml.tokens"].index(token)


# ---------------------------------------------------------------- tokenizer


def test_vocab_and_special_ids_follow_metadata(tok: GGUFTokenizer, meta: dict[str, Any]) -> None:
    tokens = meta["tokenizer.ggml.tokens"]
    assert tok.vocab_size == len(tokens) == len(tok.tokens)
    assert tok.bos_id == meta["tokenizer.ggml.bos_token_id"]
    assert tok.eos_id == meta["tokenizer.ggml.eos_token_id"]
    assert tok.add_bos == meta["tokenizer.ggml.add_bos_token"]
    control = {i for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == 3}
    assert tok.special_ids >= control
    for i in (0, 17, 1000, len(tokens) - 1):
        assert tok.id_to_token(i) == tokens[i]
        assert tok.token_to_id(tokens[i]) == i


@pytest.mark.parametrize("name", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
def test_special_token_is_one_id_in_text(tok: GGUFTokenizer, meta: dict[str, Any], name: str) -> None:
    tid = _id(meta, name)
    assert meta["tokenizer.ggml.token_type"][tid] == 3
    assert tok.token_to_id(name) == tid
    assert tok.encode(name) == [tid]
    text = f"a{name}b"
    ids = tok.encode(text)
    assert ids == [*tok.encode("a"), tid, *tok.encode("b")]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "ab"


def test_known_encodings(tok: GGUFTokenizer, meta: dict[str, Any]) -> None:
    assert tok.encode("Hello world") == [_id(meta, "Hello"), _id(meta, "Ġworld")]
    assert tok.encode("1984") == [_id(meta, d) for d in "1984"]
    # llama.cpp's smollm pre-tokenizer splits every \p{N} char off first: " ½" is "Ġ" + "½" (bytes C2 BD).
    # Plain GPT-2 splitting would give "ĠÂ" + "½" instead.
    assert tok.encode(" ½") == [_id(meta, "Ġ"), _id(meta, "Â½")]


ROUND_TRIP = [
    "Hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n  indented",
    "Crème brûlée, naïve façade, Ærøskøbing",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "中文字符和日本語のテキスト、한국어",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷",
    "digits 0123456789 3.14159 1,000,000 x²½",
    "code: def f(x):\n    return x ** 2  # ok",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u3000ideographic",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok: GGUFTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_add_bos(tok: GGUFTokenizer) -> None:
    plain = tok.encode("Hi")
    assert tok.encode("Hi", add_bos=True) == [tok.bos_id, *plain]
    assert tok.encode("Hi", add_bos=False) == plain


def test_offsets_are_character_spans(tok: GGUFTokenizer) -> None:
    text = "é 中😀<|im_end|>x"
    ids, offsets = tok.encode_offsets(text)
    assert ids == tok.encode(text)
    assert "".join(dict.fromkeys(text[a:b] for a, b in offsets)) == text


@pytest.mark.parametrize(
    ("key", "value"),
    [("tokenizer.ggml.model", "llama"), ("tokenizer.ggml.pre", "no-such-pre"), ("tokenizer.ggml.tokens", [])],
)
def test_unsupported_metadata_names_field(meta: dict[str, Any], key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_tokenizer({**meta, key: value})


def test_load_tokenizer_from_file(smollm2_path: Path, tok: GGUFTokenizer) -> None:
    loaded = load_tokenizer(smollm2_path)
    text = "The capital of France is Paris. 42 <|im_end|>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.chat_template == tok.chat_template


# ---------------------------------------------------------------- chat template


def test_chatml_render_exact(template: str) -> None:
    msgs = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
    ]
    expected = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert render_chat(template, msgs) == system + expected
    with_system = [{"role": "system", "content": "Be brief."}, *msgs]
    assert render_chat(template, with_system) == "<|im_start|>system\nBe brief.<|im_end|>\n" + expected
    assert render_chat(template, msgs[:1], add_generation_prompt=True).endswith(
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of 1s."""
    runs, start = [], None
    for k, m in enumerate([*mask, 0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            runs.append((start, k))
            start = None
    return runs


def _check_turns(tok: GGUFTokenizer, ids: list[int], mask: list[int], replies: list[str], end: str) -> None:
    end_id = tok.token_to_id(end)
    runs = mask_runs(mask)
    assert len(runs) == len(replies)
    for (a, b), reply in zip(runs, replies, strict=True):
        assert ids[a:b] == [*tok.encode(reply), end_id]
        assert tok.decode(ids[a:b]) == reply + end


def test_mask_two_turns(tok: GGUFTokenizer, template: str) -> None:
    msgs = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
    ]
    ids, mask = tokenize_chat(tok, template, msgs)
    assert ids == tok.encode(render_chat(template, msgs))
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    _check_turns(tok, ids, mask, ["Hello! How can I help?"], "<|im_end|>")
    assert ids[-1] == tok.encode("\n")[0] and mask[-1] == 0  # the newline after <|im_end|> is not trained


def test_mask_five_messages(tok: GGUFTokenizer, template: str) -> None:
    replies = ["Paris is the capital of France.", "Environ 2,1 millions d'habitants 🇫🇷."]
    msgs = [
        {"role": "system", "content": "You answer geography questions."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": "Et sa population ?"},
        {"role": "assistant", "content": replies[1]},
    ]
    ids, mask = tokenize_chat(tok, template, msgs)
    assert ids == tok.encode(render_chat(template, msgs))
    _check_turns(tok, ids, mask, replies, "<|im_end|>")
    unmasked = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    for msg in msgs[:2] + msgs[3:4]:
        assert msg["content"] in unmasked


def test_mask_content_that_looks_like_the_template(tok: GGUFTokenizer, template: str) -> None:
    # Contents equal to header words: only the rendered message positions count, not the first text match.
    msgs = [{"role": "user", "content": "system"}, {"role": "assistant", "content": "assistant"}]
    ids, mask = tokenize_chat(tok, template, msgs)
    _check_turns(tok, ids, mask, ["assistant"], "<|im_end|>")
    ((a, _b),) = mask_runs(mask)
    assert tok.decode(ids[:a]).endswith("<|im_start|>assistant\n")


def test_mask_other_template_and_trimmed_content(tok: GGUFTokenizer) -> None:
    # Not ChatML: role labels, trimmed content, eos closes the assistant turn (falls back to text search).
    tpl = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] | trim }}"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    )
    msgs = [
        {"role": "user", "content": "assistant"},
        {"role": "assistant", "content": "  Sure, user.  "},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "USER: again"},
    ]
    ids, mask = tokenize_chat(tok, tpl, msgs)
    assert tok.decode(ids).startswith(f"{tok.bos_token}USER: assistant\nASSISTANT: Sure, user.{tok.eos_token}")
    # "ASSISTANT: Sure" tokenizes as ":" "ĠSure": the token straddling the content start is trained.
    _check_turns(tok, ids, mask, [" Sure, user.", " USER: again"], tok.eos_token)


def test_block_whitespace_like_hf() -> None:
    # HF renders with trim_blocks + lstrip_blocks: block tags on their own lines leave no blank lines.
    tpl = "{% for m in messages %}\n    {% if m['role'] == 'user' %}\n{{ m['content'] }}\n    {% endif %}\n{% endfor %}"
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "b"},
    ]
    assert render_chat(tpl, msgs) == "a\nb\n"


def test_generation_tag_renders_body(template: str) -> None:
    tagged = template.replace("{{'<|im_start|>'", "{% generation %}{{'<|im_start|>'").replace(
        "{% endfor %}", "{% endgeneration %}{% endfor %}"
    )
    assert "generation" in tagged
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render_chat(tagged, msgs) == render_chat(template, msgs)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}], r"messages\[1\] has no 'content'"),
        ([{"role": "robot", "content": "hi"}], r"messages\[0\]\.role='robot'"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string"),
        (["hi"], r"messages\[0\] must be a dict"),
        ("hi", "messages must be a list"),
    ],
)
def test_bad_messages(tok: GGUFTokenizer, template: str, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_messages(messages)
    with pytest.raises(ValueError, match=match):
        tokenize_chat(tok, template, messages)


def test_role_the_template_drops(tok: GGUFTokenizer) -> None:
    tpl = (
        "{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
        "{% elif m['role'] == 'assistant' %}A: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    )
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match=r"messages\[0\] \(role 'system'\).*unknown to the chat template"):
        tokenize_chat(tok, tpl, msgs)


def test_template_raise_exception_and_sandbox() -> None:
    tpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert render_chat(tpl, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first must be user"):
        render_chat(tpl, [{"role": "assistant", "content": "x"}])
    with pytest.raises(SecurityError):
        render_chat("{{ messages.append(1) }}", [])


# ---------------------------------------------------------------- pre-tokenizers against transformers' GGUF tokenizer

ORACLE_TEXTS = [
    *ROUND_TRIP,
    "Hello, world!! (this) is it... 12345 678 x²½ ³⁄₄ ٣٤٥ 一二三",
    "I'm you'll WE'D don’t SHE'S it'S — «guillemets» “quotes” ‘single’",
    "a...b---c $100 +=<>^~| 3.14159 #tag @user https://example.com/a?b=c&d=e",
    "Ünïcödé: Ελληνικά Русский עברית العربية हिन्दी ไทย 日本語",
    "line\n\n\nbreaks \r\n  trailing   \t\n",
    "<|im_start|>user\nHi 👋🏾!<|im_end|>",
]


def _write_tokenizer_gguf(folder: Path, meta: dict[str, Any], pre: str) -> dict[str, Any]:
    """A GGUF holding only SmolLM2's vocabulary and merges with tokenizer.ggml.pre = `pre`; its metadata."""
    from model.gguf import write_gguf

    tok_meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")} | {"tokenizer.ggml.pre": pre}
    write_gguf(folder / f"{pre}.gguf", "llama", tok_meta, [])
    return tok_meta


@pytest.fixture(scope="module")
def hf_tokenizers(meta: dict[str, Any], tmp_path_factory: pytest.TempPathFactory):
    """pre -> (ours, transformers' tokenizer built by its GGUF loader from the same file)."""
    import os

    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for pre in ("qwen2", "llama-bpe", "gpt2"):
        tok_meta = _write_tokenizer_gguf(folder, meta, pre)
        hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=f"{pre}.gguf")
        out[pre] = build_tokenizer(tok_meta), hf
    return out


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2"])
def test_ids_match_transformers(hf_tokenizers, pre: str) -> None:
    """Qwen2's and Llama 3's BPE pre-tokenizers (and GPT-2's): the same ids as transformers on varied Unicode."""
    ours, hf = hf_tokenizers[pre]
    for text in ORACLE_TEXTS:
        assert ours.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False), (pre, text)


def _llama_cpp_default_pieces(text: str) -> list[str]:
    """llama.cpp's default BPE pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_DEFAULT), written with the `regex` module: each
    regex splits every current piece into its matches and the text between them, in turn."""
    import regex

    patterns = (
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    )
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            start = 0
            for m in regex.finditer(pattern, piece):
                if m.start() > start:
                    out.append(piece[start : m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                start = m.end()
            if start < len(piece):
                out.append(piece[start:])
        pieces = out
    return pieces


def test_default_pre_tokenizer_is_llama_cpps(hf_tokenizers, meta: dict[str, Any]) -> None:
    """tokenizer.ggml.pre = default: llama.cpp's pieces (an independent regex-module split), each BPE-encoded by
    transformers; transformers itself maps 'default' to GPT-2's regex, which splits punctuation differently."""
    ours = build_tokenizer({**meta, "tokenizer.ggml.pre": "default"})
    _, hf = hf_tokenizers["gpt2"]
    special = ("<|im_start|>", "<|im_end|>")
    for text in ORACLE_TEXTS:
        if any(s in text for s in special):
            continue  # special tokens are matched before pre-tokenization; covered by the tests above
        expect = [i for piece in _llama_cpp_default_pieces(text) for i in hf.encode(piece, add_special_tokens=False)]
        assert ours.encode(text, add_bos=False) == expect, text
    assert ours.encode(" (x)", add_bos=False) != hf.encode(" (x)", add_special_tokens=False)  # " " "(" vs " ("
    assert _llama_cpp_default_pieces("Hi, (you) 12345!") == ["Hi", ",", " ", "(", "you", ")", " ", "123", "45", "!"]
