"""Preflight: refuse bad inputs before any stage runs (and before a Prefect server is started by the CLI).

Checks what can be checked from file headers: both GGUFs models distillery can run, tokenizer included
(model.gguf.check_model_file: architecture, family settings, tensors, quant types), the same vocabulary
(data.topk.check_vocab), data.seq_len within both context lengths, top_k within the vocabulary, lora.layers
within the blocks, the data path present and its first document readable (data.records.check_first_document: the
field names, the format, the encoding), the held-out data not the training data. Problems further into the data (a
bad line 2, a dataset of blank documents) surface in tokenize with the file and record named.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as Q

from data.records import check_first_document, resolve_format
from data.topk import check_vocab
from model.config import ModelConfig
from model.convert import EMBEDDING_TENSORS
from model.engine_spec import check_group_dims
from model.gguf import GGUFError, GGUFFile, check_model_file
from model.quant import QuantError, choose_student_type
from schemas.config import RunConfig


class InputError(ValueError):
    """A run input is unusable; the message names the file and the config field."""


def _open(path: Path, field: str) -> tuple[list[str], ModelConfig]:
    """(tokens, ModelConfig) of a GGUF model; InputError naming the config field otherwise."""
    if not Path(path).is_file():
        raise InputError(f"{field}: {path}: no such GGUF file")
    try:
        mcfg = check_model_file(path)  # architecture, family settings, tensors, quant types, tokenizer
        with GGUFFile(path) as f:
            tokens = list(f.metadata.get("tokenizer.ggml.tokens") or [])
    except GGUFError as exc:
        raise InputError(f"{field}: {exc}") from None
    if not tokens:
        raise InputError(f"{field}: {path}: no tokenizer.ggml.tokens (a model GGUF with its tokenizer)")
    return tokens, mcfg


def check_inputs(cfg: RunConfig) -> None:
    """Raise InputError (a ValueError) on the first unusable input; returns quietly otherwise."""
    student, s_cfg = _open(cfg.model.student, "model.student")
    teacher, t_cfg = _open(cfg.model.teacher, "model.teacher")
    try:
        check_vocab(teacher, student, cfg.model.teacher, cfg.model.student)
    except ValueError as exc:
        raise InputError(f"model.student: {exc}") from None
    for field, path, ctx in (
        ("model.student", cfg.model.student, s_cfg.context_length),
        ("model.teacher", cfg.model.teacher, t_cfg.context_length),
    ):
        if cfg.data.seq_len > ctx:
            raise InputError(f"data.seq_len: {cfg.data.seq_len} exceeds the context length {ctx} of {field} {path}")
    if cfg.teacher.top_k > len(teacher):  # the sampled store's eval split is top-k too
        raise InputError(f"teacher.top_k: {cfg.teacher.top_k} exceeds the vocabulary size {len(teacher)}")
    _check_lora(cfg, s_cfg)
    _check_student_quant(cfg)
    for field, path in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        if path is None:
            continue
        d = cfg.data
        try:
            if cfg.run.task == "distill":  # the format and the first document
                check_first_document(path, d.format, d.text_field, d.messages_field)
            else:  # a preference run's records are pairs (stages/pairs.py reads them)
                resolve_format(path, d.format)
        except ValueError as exc:
            raise InputError(f"{field}: {exc}") from None
    _check_held_out(cfg)


def _check_lora(cfg: RunConfig, student: ModelConfig) -> None:
    """lora.layers inside the student's blocks; lora.r at most its hidden size (a rank above min(in, out) of a
    projection adds parameters and no capacity)."""
    if cfg.lora.layers is not None and max(cfg.lora.layers) >= student.n_layers:
        raise InputError(
            f"lora.layers: {list(cfg.lora.layers)} outside the blocks 0..{student.n_layers - 1} of model.student "
            f"{cfg.model.student}"
        )
    if cfg.lora.r > student.hidden:
        raise InputError(
            f"lora.r: {cfg.lora.r} exceeds the hidden size {student.hidden} of model.student {cfg.model.student}; "
            "an adapter's rank is at most min(in, out) of its projection"
        )
    if cfg.lora.group:
        try:
            check_group_dims(student, cfg.lora.targets, cfg.lora.group)
        except ValueError as exc:
            raise InputError(f"{exc} (model.student {cfg.model.student})") from None


def _check_student_quant(cfg: RunConfig) -> None:
    """Every 2-D weight of the student gets a type of model.student_quant (its row length a multiple of the
    type's block), checked from the header before any work."""
    quant = cfg.model.student_quant
    if quant is None:
        return
    if len(quant) > 2:
        raise InputError(f"model.student_quant: {list(quant)}: give one or two types (preferred, fallback)")
    with GGUFFile(cfg.model.student) as f:
        for info in f.tensors.values():
            if len(info.ne) < 2 or info.name in EMBEDDING_TENSORS:
                continue
            try:
                choose_student_type(info.ne[0], Q[quant[0]], Q[quant[-1]])
            except QuantError as exc:
                raise InputError(
                    f"model.student_quant: {list(quant)}: tensor '{info.name}' of model.student "
                    f"{cfg.model.student}: {exc}"
                ) from None


def _check_held_out(cfg: RunConfig) -> None:
    """data.eval_path must not be data.path (or a file of it): the held-out metrics would be training metrics."""
    if cfg.data.eval_path is None:
        return
    train = {f.resolve() for f in resolve_format(cfg.data.path, cfg.data.format)[1]}
    shared = sorted(str(f) for f in resolve_format(cfg.data.eval_path, cfg.data.format)[1] if f.resolve() in train)
    if shared:
        raise InputError(
            f"data.eval_path: {cfg.data.eval_path}: the training data (data.path {cfg.data.path}) includes "
            f"{shared[0]}; held-out data must be other documents (or unset eval_path to hold out data.eval_fraction)"
        )
