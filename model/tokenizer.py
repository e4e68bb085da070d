"""A `tokenizers.Tokenizer` built from GGUF tokenizer metadata (no hub, no tokenizer.json): byte-level BPE
(tokenizer.ggml.model = gpt2) with llama.cpp's pre-tokenizers, and Gemma's sentencepiece BPE (tokenizer.ggml.model =
llama in a gemma3 file) as HF's GemmaTokenizer runs it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.pre_tokenizers import PreTokenizer

from model.gguf_reader import GGUFFile

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of llama.cpp's pre-tokenizer types (llama-vocab.cpp), in HF `tokenizers` syntax.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT (tokenizer.ggml.pre = "default", or missing in older conversions): four
# regexes applied one after the other, each splitting every piece the previous one left (matches and the text
# between them both kept), then byte-level mapping. Punctuation runs are cut off first, so " (x)" becomes
# " ", "(", "x", ")" where GPT-2's regex gives " (", "x", ")".
_DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


def _gpt2() -> PreTokenizer:
    """GPT-2 regex + byte-level mapping."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _starcoder() -> PreTokenizer:
    """Every digit on its own (`\\p{N}`), then the GPT-2 regex + byte-level (llama.cpp STARCODER/SMOLLM)."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2()],
    )


def _split_then_bytes(*regexes: str) -> Callable[[], PreTokenizer]:
    """Split by each regex in turn (llama.cpp's unicode_regex_split: matches and gaps kept), then byte-level."""

    def build() -> PreTokenizer:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    return build


# tokenizer.ggml.pre value -> pre-tokenizer factory (names as llama.cpp's llama-vocab.cpp groups them).
PRE_TOKENIZERS: dict[str, Callable[[], PreTokenizer]] = {
    **dict.fromkeys(("gpt2", "mpt", "olmo", "jais", "exaone4"), _gpt2),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), _starcoder),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _split_then_bytes(_LLAMA3_REGEX)
    ),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), _split_then_bytes(_QWEN2_REGEX)),
    "default": _split_then_bytes(*_DEFAULT_REGEXES),
}


# Architectures whose sentencepiece vocabulary (tokenizer.ggml.model = "llama") we build: Gemma's is BPE with byte
# fallback, no prefix space, and merges in the order of the vocabulary. (Llama 2 / Mistral's differ: a prefix
# space and score-ordered merges; they stay refused.)
SENTENCEPIECE_ARCHITECTURES = ("gemma3",)
SPACE_PIECE = "\u2581"  # sentencepiece's visible space


def _position_merges(vocab: Mapping[str, int], tokens: Sequence[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary whose order is its merge order (Gemma's: its scores are
    not): every split of a token into two vocabulary pieces, earlier tokens first; for one token, the split with
    the longer left piece first, then by the pieces' ids (how transformers rebuilds them for a Gemma GGUF)."""
    rank = {token: -index for index, token in enumerate(tokens)}  # a repeated string ranks by its last place
    merges = []
    for token, score in rank.items():
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece(tokens: list[str], unk: str | None) -> tuple[Tokenizer, dict[str, int]]:
    """Gemma's tokenizer: spaces written as U+2581, BPE over the whole text with byte fallback (<0xXX> tokens)
    and unknowns fused, decoded back through the byte tokens. A token of two or more spaces, stored as real
    spaces in the GGUF, is looked up as that many U+2581 (as HF's tokenizer spells it). Returns the tokenizer and
    its vocabulary (a repeated string keeps its last id, as transformers' GGUF loader does)."""
    spelled = [SPACE_PIECE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    hf = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_position_merges(vocab, spelled),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    hf.normalizer = normalizers.Replace(" ", SPACE_PIECE)
    hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # HF's; spaces are gone by now
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return hf, vocab


class GGUFTokenizer:
    """A GGUF vocabulary as a HF `tokenizers.Tokenizer` (`.hf`) plus the ids llama.cpp reads from metadata."""

    def __init__(
        self,
        hf: Tokenizer,
        tokens: list[str],
        *,
        bos_id: int | None,
        eos_id: int | None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        special_ids: frozenset[int] = frozenset(),
        pre: str = "",
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf
        self.tokens = tokens
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.special_ids = special_ids
        self.pre = pre
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.tokens[self.bos_id]

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.tokens[self.eos_id]

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their single ids.

        add_bos=None follows tokenizer.ggml.add_bos_token.
        """
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos requested but the GGUF has no tokenizer.ggml.bos_token_id")
            ids = [self.bos_id, *ids]
        return ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (no BOS) and each token's [start, end) character span in `text`."""
        enc = self.hf.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids` (special tokens kept unless skip_special)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self.tokens[token_id]

    def __repr__(self) -> str:
        return f"GGUFTokenizer(vocab={self.vocab_size}, pre={self.pre!r}, bos={self.bos_id}, eos={self.eos_id})"


def _opt_id(metadata: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < n_vocab:
        raise ValueError(f"{key}={value} is outside the vocabulary (size {n_vocab})")
    return value


def _split_merge(merge: str) -> tuple[str, str]:
    # The separator is the first space after position 0 (as llama.cpp parses it).
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ValueError(f"tokenizer.ggml.merges: entry {merge!r} is not 'left right'")
    return merge[:cut], merge[cut + 1 :]


def check_tokenizer_metadata(metadata: Mapping[str, Any]) -> None:
    """ValueError naming the key when the GGUF's tokenizer is one we cannot build (cheap: nothing is built).

    The model kind (tokenizer.ggml.model: byte-level BPE 'gpt2', or sentencepiece 'llama' in a gemma3 file), the
    pre-tokenizer of a byte-level BPE (tokenizer.ggml.pre), a non-empty vocabulary and a token_type array of the
    same length."""
    model = metadata.get("tokenizer.ggml.model")
    arch = metadata.get("general.architecture")
    sentencepiece = model == "llama" and arch in SENTENCEPIECE_ARCHITECTURES
    if model != "gpt2" and not sentencepiece:
        raise ValueError(
            f"tokenizer.ggml.model={model!r} is not supported (byte-level BPE 'gpt2', and sentencepiece 'llama' in "
            f"{', '.join(SENTENCEPIECE_ARCHITECTURES)} files, are implemented)"
        )
    pre = metadata.get("tokenizer.ggml.pre")
    if not sentencepiece and pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer.ggml.pre={pre!r} is not supported; known values: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None or not len(tokens):
        raise ValueError("tokenizer.ggml.tokens is missing or empty")
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None and len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries, tokenizer.ggml.tokens has {len(tokens)}")


def build_tokenizer(metadata: Mapping[str, Any]) -> GGUFTokenizer:
    """The tokenizer of GGUF `tokenizer.ggml.*` metadata: byte-level BPE (tokenizer.ggml.model == "gpt2"), or
    Gemma's sentencepiece BPE ("llama" in a gemma3 file)."""
    check_tokenizer_metadata(metadata)
    sentencepiece = metadata["tokenizer.ggml.model"] == "llama"
    pre = metadata.get("tokenizer.ggml.pre", "")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    n = len(tokens)
    types = metadata.get("tokenizer.ggml.token_type")
    types = [TOKEN_NORMAL] * n if types is None else [int(t) for t in types]
    merges = [_split_merge(m) for m in metadata.get("tokenizer.ggml.merges") or []]

    bos_id = _opt_id(metadata, "tokenizer.ggml.bos_token_id", n)
    eos_id = _opt_id(metadata, "tokenizer.ggml.eos_token_id", n)
    unk_id = _opt_id(metadata, "tokenizer.ggml.unknown_token_id", n)
    pad_id = _opt_id(metadata, "tokenizer.ggml.padding_token_id", n)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))

    unk = None if unk_id is None else tokens[unk_id]
    if sentencepiece:
        hf, vocab = _sentencepiece(tokens, unk)
    else:
        vocab = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(tok, i)  # a duplicated string keeps its first id, as in HF vocab files
        hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=False, byte_fallback=False))
        hf.pre_tokenizer = PRE_TOKENIZERS[pre]()
        hf.decoder = decoders.ByteLevel()

    special = {i for i, t in enumerate(types) if t == TOKEN_CONTROL}
    special |= {i for i in (bos_id, eos_id) if i is not None}
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)])
    # user-defined tokens are matched whole; a sentencepiece one the vocabulary spells otherwise (a run of spaces)
    # is left to the BPE, which reaches it through its U+2581 spelling
    user = [i for i, t in enumerate(types) if t == TOKEN_USER_DEFINED and i not in special and tokens[i] in vocab]
    if user:
        hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    elif not sentencepiece:
        hf.post_processor = processors.ByteLevel(trim_offsets=False)

    return GGUFTokenizer(
        hf,
        tokens,
        bos_id=bos_id,
        eos_id=eos_id,
        unk_id=unk_id,
        pad_id=pad_id,
        add_bos=add_bos,
        special_ids=frozenset(special),
        pre=str(pre),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def load_tokenizer(path: str | Path) -> GGUFTokenizer:
    """Tokenizer of the GGUF file at `path`."""
    with GGUFFile(path) as gf:
        metadata = gf.metadata
    try:
        return build_tokenizer(metadata)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
