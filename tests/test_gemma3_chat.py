"""Gemma 3's chat template (the instruction-tuned models' `chat_template`: system message folded into the first user
turn, "assistant" written as "model", contents trimmed) rendered and tokenized by model/chat.py against
transformers' `apply_chat_template` with its GemmaTokenizer loaded from the same GGUF: the text and the ids, with
and without the generation prompt, and the assistant loss mask against HF's `return_assistant_tokens_mask` over the
same template with `{% generation %}` around the model turns' contents. On the tiny vocabulary of
tests/test_gemma3_tokenizer.py (fast), and on the published 270M file's 262,144 entries when it is there (the
published base file carries no chat template; the instruction-tuned one's is passed to both sides).

tests/data/gemma3-it-chat-template.jinja is, byte for byte, `_CHAT_TEMPLATE` of transformers'
src/transformers/models/gemma3/convert_gemma3_weights.py (huggingface/transformers), the template written into
google/gemma-3-*-it's tokenizer_config.json and carried by their GGUFs as tokenizer.chat_template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from model.chat import content_spans, render_chat, tokenize_chat
from model.gguf import write_gguf
from model.tokenizer import GGUFTokenizer, build_tokenizer, load_tokenizer
from tests.test_gemma3_real import _published_file
from tests.test_gemma3_tokenizer import _metadata as tiny_gemma3_metadata
from tests.test_tokenizer import mask_runs

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

TEMPLATE = (Path(__file__).parent / "data" / "gemma3-it-chat-template.jinja").read_text(encoding="utf-8")
CONTENT = "{{ message['content'] | trim }}"
# the same template with HF's assistant-mask tag around the model turns' contents (renders the same text)
TAGGED = TEMPLATE.replace(
    CONTENT,
    f"{{% if role == 'model' %}}{{% generation %}}{CONTENT}{{% endgeneration %}}{{% else %}}{CONTENT}{{% endif %}}",
)

CHATS: dict[str, list[dict[str, str]]] = {
    "system-folded-multi-turn": [
        {"role": "system", "content": "You are hello world.\nAnswer   in  the   world."},
        {"role": "user", "content": "hello 世界 🤗 é, 123 1234?"},
        {"role": "assistant", "content": "the  world   hello 12 3"},
        {"role": "user", "content": "abc\n\nhello\nthe"},
        {"role": "assistant", "content": "héllo wörld 🤗 ١٢٣ 12345"},
    ],
    "no-system": [
        {"role": "user", "content": "the abc"},
        {"role": "assistant", "content": "hello  world"},
    ],
    "one-user-turn": [{"role": "user", "content": "  hello\tworld  "}],
    "trimmed-contents": [
        {"role": "system", "content": "  sys  "},
        {"role": "user", "content": "\n  hello \n"},
        {"role": "assistant", "content": "  the world \n\n"},
        {"role": "user", "content": " 12 "},
        {"role": "assistant", "content": "\t123\t"},
    ],
    "contents-like-the-template": [  # only the rendered places count, not the first match of the text
        {"role": "system", "content": " user\n"},  # folded as is, where the turns' contents are trimmed
        {"role": "user", "content": "model"},
        {"role": "assistant", "content": " model "},
        {"role": "user", "content": "user"},
        {"role": "assistant", "content": "<end_of_turn>user"},
    ],
}


def _theirs(hf: Any, messages: list[dict[str, str]], template: str, add_generation_prompt: bool) -> dict[str, Any]:
    return hf.apply_chat_template(
        messages,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )


def check_against_transformers(
    ours: GGUFTokenizer, hf: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    """Rendered text, ids and the assistant mask equal transformers'; the mask's runs are each model turn's
    content and the <end_of_turn> that closes it (the project's convention), and nothing else."""
    text = render_chat(TEMPLATE, messages, add_generation_prompt, bos_token=ours.bos_token, eos_token=ours.eos_token)
    assert text == hf.apply_chat_template(
        messages, chat_template=TEMPLATE, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert render_chat(TAGGED, messages, add_generation_prompt, bos_token="<bos>") == text
    ids, mask = tokenize_chat(ours, TEMPLATE, messages, add_generation_prompt=add_generation_prompt)
    theirs = _theirs(hf, messages, TAGGED, add_generation_prompt)
    assert ids == theirs["input_ids"] == ours.encode(text, add_bos=False)
    assert ids[0] == ours.bos_id and ids.count(ours.bos_id) == 1  # the template's {{ bos_token }}, once

    end_of_turn = ours.token_to_id("<end_of_turn>")
    # HF's mask is the tagged contents; ours adds the <end_of_turn> right after each of them
    closing = {b for a, b in mask_runs(theirs["assistant_masks"])}
    assert [int(m or k in closing) for k, m in enumerate(theirs["assistant_masks"])] == mask
    replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    runs = mask_runs(mask)
    assert len(runs) == len(replies)
    for (a, b), reply in zip(runs, replies, strict=True):
        assert ids[a:b] == [*ours.encode(reply, add_bos=False), end_of_turn]
        assert ours.decode(ids[:a]).endswith("<start_of_turn>model\n")
        assert ours.tokens[ids[b]] == "\n"  # the newline after <end_of_turn> is not trained


# ---------------------------------------------------------------- the tiny vocabulary (fast)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFTokenizer, Any]:
    """Ours from the written file (the template read back from tokenizer.chat_template), HF's from the same file."""
    folder = tmp_path_factory.mktemp("gemma3_chat")
    meta = {**tiny_gemma3_metadata(), "tokenizer.chat_template": TEMPLATE}
    write_gguf(folder / "tok.gguf", "gemma3", meta, [])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="tok.gguf")
    ours = load_tokenizer(folder / "tok.gguf")
    assert ours.chat_template == TEMPLATE
    return ours, hf


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", CHATS)
def test_tiny_vocabulary_matches_transformers(tiny: tuple, name: str, add_generation_prompt: bool) -> None:
    ours, hf = tiny
    check_against_transformers(ours, hf, CHATS[name], add_generation_prompt)


def test_render_exact(tiny: tuple) -> None:
    """What the template writes, spelled out: the system message and a blank line open the first user turn."""
    ours, _ = tiny
    msgs = CHATS["system-folded-multi-turn"][:3]
    assert render_chat(TEMPLATE, msgs, True, bos_token=ours.bos_token) == (
        "<bos><start_of_turn>user\nYou are hello world.\nAnswer   in  the   world.\n\nhello 世界 🤗 é, 123 1234?"
        "<end_of_turn>\n<start_of_turn>model\nthe  world   hello 12 3<end_of_turn>\n<start_of_turn>model\n"
    )


def test_spans_of_trimmed_contents() -> None:
    """Each content's place in the render, trimmed where the template trims it (the turns), as is where it does
    not (the folded system message: its whitespace stays in the text, outside its span)."""
    msgs = CHATS["contents-like-the-template"]
    text = render_chat(TEMPLATE, msgs, bos_token="<bos>")
    spans = content_spans(TEMPLATE, msgs, text, bos_token="<bos>")
    assert [text[a:b] for a, b in spans] == [m["content"].strip() for m in msgs]
    assert text[: spans[0][0]] == "<bos><start_of_turn>user\n " and text[spans[0][1] :].startswith("\n\n\nmodel")
    for (a, _), msg in zip(spans, msgs, strict=True):
        if msg["role"] == "assistant":
            assert text[:a].endswith("<end_of_turn>\n<start_of_turn>model\n")


def test_roles_must_alternate(tiny: tuple) -> None:
    ours, _ = tiny
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="chat template: Conversation roles must alternate"):
        tokenize_chat(ours, TEMPLATE, msgs)


def test_build_tokenizer_keeps_the_template() -> None:
    meta = {**tiny_gemma3_metadata(), "tokenizer.chat_template": TEMPLATE}
    assert build_tokenizer(meta).chat_template == TEMPLATE


# ---------------------------------------------------------------- the published 270M vocabulary


PUBLISHED_CHAT = [
    {"role": "system", "content": "You are a helpful assistant. Réponds en français si besoin."},
    {"role": "user", "content": "Zürich, São Paulo, Kraków, Đà Nẵng — 3.14159 × 10⁻⁹?"},
    {"role": "assistant", "content": "def f(x):\n    return x**2  # square\n\n🏳️‍🌈 👨‍👩‍👧"},
    {"role": "user", "content": "  two  spaces   three    four\n\n\tand a tab"},
    {"role": "assistant", "content": "\u200b zero width \u00a0 nbsp ﬁ 中文字日本語한국어"},
]


@pytest.fixture(scope="module")
def published() -> tuple[GGUFTokenizer, Any]:
    path = _published_file()
    if path is None or not path.is_file():
        pytest.skip("the published Gemma 3 270M GGUF is absent (see tests/test_gemma3_real.py)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = load_tokenizer(path)
    assert ours.vocab_size == 262_144 and ours.chat_template is None  # the base file: the -it template is passed
    return ours, hf


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", [*CHATS, "published"])
def test_published_vocabulary_matches_transformers(published: tuple, name: str, add_generation_prompt: bool) -> None:
    ours, hf = published
    check_against_transformers(ours, hf, CHATS.get(name, PUBLISHED_CHAT), add_generation_prompt)
