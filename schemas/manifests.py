"""Small JSON-serialisable manifests that pipeline stages return (paths, sha256s, counts, metrics).

Never arrays or GPU objects. A stage's manifest knows where its files are: paths are strings relative to the
run's workdir (absolute when outside it), and `path_in(workdir)` gives the stage's output on disk (its folder,
or the file for the student). `FileRef.verify(workdir)` checks a file by size and sha256, and a stage's
manifest lists the files it stands for in `outputs()` (what the stage cache verifies before reusing a result).
The same classes describe files written by library code (data/), which leaves `dir` empty: such a manifest is
not placed yet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

SHA256 = r"^[0-9a-f]{64}$"


class ManifestError(ValueError):
    """A file a manifest names is missing or differs from what the manifest recorded."""


class Manifest(BaseModel):
    """Base: immutable, unknown keys rejected, inf/nan written as JSON constants so metrics round-trip."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    def outputs(self) -> tuple[FileRef, ...]:
        """The files this result stands for, each with its size and sha256 (none for pure values)."""
        return ()


def stored_path(path: str | Path, workdir: str | Path) -> str:
    """How a manifest stores a path: relative to the workdir when under it, else absolute (POSIX form)."""
    path, root = Path(path).resolve(), Path(workdir).resolve()
    return (path.relative_to(root) if path.is_relative_to(root) else path).as_posix()


def _in(path: str, workdir: str | Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else Path(workdir) / p


class Located(Manifest):
    """A stage result whose files live in one folder: `dir`, relative to the run's workdir."""

    dir: str = Field(
        "",
        exclude_if=lambda v: not v,  # files written by library code (no stage yet) keep their on-disk form
        description="the stage's output folder, relative to the workdir (absolute when outside it)",
    )

    def path_in(self, workdir: str | Path) -> Path:
        """The output folder on disk."""
        if not self.dir:
            raise ManifestError(f"{type(self).__name__}: no output folder recorded (not returned by a stage)")
        return _in(self.dir, workdir)

    def at(self, folder: str | Path, workdir: str | Path) -> Self:
        """This manifest with `dir` set to `folder` (stored relative to the workdir)."""
        return self.model_copy(update={"dir": stored_path(folder, workdir)})


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 hex of a file, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class FileRef(Manifest):
    """A file by path, content hash and size."""

    path: str
    sha256: str = Field(pattern=SHA256)
    bytes: int = Field(ge=0)

    @classmethod
    def of(cls, path: str | Path, root: str | Path | None = None) -> FileRef:
        """Hash a file on disk; the stored path is relative to `root` when given."""
        path = Path(path)
        full = Path(root) / path if root is not None and not path.is_absolute() else path
        stored = path if root is None or not path.is_absolute() else path.relative_to(root)
        return cls(path=stored.as_posix(), sha256=sha256_file(full), bytes=full.stat().st_size)

    def resolve(self, root: str | Path | None = None) -> Path:
        """The path on disk (relative paths are taken relative to `root`)."""
        return Path(self.path) if root is None else _in(self.path, root)

    def moved(self, path: str | Path, workdir: str | Path) -> FileRef:
        """The same content recorded at `path` (stored relative to the workdir)."""
        return self.model_copy(update={"path": stored_path(path, workdir)})

    def verify(self, root: str | Path | None = None, sha256: Callable[[Path], str] = sha256_file) -> Path:
        """Check the file exists with the recorded size and sha256; return its path. `sha256` hashes a file
        (a memoised hasher skips re-reading a large file whose size and mtime are unchanged)."""
        full = self.resolve(root)
        if not full.is_file():
            raise ManifestError(f"{full}: file missing")
        size = full.stat().st_size
        if size != self.bytes:
            raise ManifestError(f"{full}: size {size} bytes, manifest says {self.bytes}")
        digest = sha256(full)
        if digest != self.sha256:
            raise ManifestError(f"{full}: sha256 {digest}, manifest says {self.sha256}")
        return full


class TokenSplit(Manifest):
    """Token shards of one split (rows follow schemas.files.TOKEN_SHARD_SCHEMA)."""

    shards: tuple[FileRef, ...]
    n_documents: int = Field(ge=0)
    n_sequences: int = Field(ge=0)
    n_positions: int = Field(ge=0, description="trained positions: sum of loss_mask")


class TokenizeManifest(Located):
    """Output of tokenize: train and eval token shards (dir: the folder holding train/ and eval/)."""

    dataset_fingerprint: str
    tokenizer_sha256: str = Field(pattern=SHA256, description="sha256 of the GGUF the tokenizer came from")
    vocab_size: int = Field(ge=1)
    seq_len: int = Field(ge=2)
    train: TokenSplit
    eval: TokenSplit

    def outputs(self) -> tuple[FileRef, ...]:
        """The .arrow data files of both splits."""
        return (*self.train.shards, *self.eval.shards)

    def shards_hash(self) -> str:
        """sha256 over the shard hashes of both splits, in order: the token-data part of later cache keys."""
        joined = "\n".join(
            f"{split}:{ref.sha256}" for split in ("train", "eval") for ref in getattr(self, split).shards
        )
        return hashlib.sha256(joined.encode()).hexdigest()


class StudentManifest(Manifest):
    """Output of the student stage: the GGUF the student is loaded from (requantized when asked)."""

    source_sha256: str = Field(pattern=SHA256, description="sha256 of model.student as given")
    file: FileRef
    requantized: bool
    tensor_types: dict[str, int] = Field(description="GGUF type name -> number of tensors of that type")

    def path_in(self, workdir: str | Path) -> Path:
        """The student GGUF on disk."""
        return self.file.resolve(workdir)

    def outputs(self) -> tuple[FileRef, ...]:
        return (self.file,)


class ShardRecord(Manifest):
    """One top-k shard; mirrors a row of schemas.files.TOPK_MANIFEST."""

    shard: int = Field(ge=0)
    file: str
    split: Literal["train", "eval"]
    seq_start: int = Field(ge=0)
    seq_end: int = Field(ge=0)
    n_positions: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256)
    complete: bool


class TeacherManifest(Located):
    """Output of the teacher stage: the teacher shard set (dir: its folder) and what it was computed from. store
    topk: k ids per position; store sampled: k = teacher.samples draws per position under `seed` on the train split,
    the eval split top-k of width eval_k (store_of / k_of say which per split)."""

    UNKEYED_DEFAULTS: ClassVar[dict[str, Any]] = {
        "store": "topk",
        "shard_schema": "topk_shard/1",
        "seed": 0,
        "eval_k": 0,
        "topk_format": "plain",
    }

    teacher_sha256: str = Field(pattern=SHA256)
    store: Literal["topk", "sampled"] = "topk"
    shard_schema: str = Field("topk_shard/1", description="the shards' versioned schema (schemas/files.py)")
    seed: int = Field(0, ge=0, description="seed of the sampled store's draws (0 for top-k)")
    k: int = Field(ge=1)
    temperature: float = Field(gt=0)
    vocab_size: int = Field(ge=1)
    token_shards_hash: str = Field(pattern=SHA256, description="TokenizeManifest.shards_hash()")
    eval_k: int = Field(
        0,
        ge=0,
        description="> 0: the eval split's shards are top-k (topk_shard/1, with tail) of this width beside a sampled "
        "train split, so held-out metrics are exact and comparable across stores; 0: stored as the train split",
    )
    topk_format: Literal["plain", "compact"] = Field(
        "plain",
        description="how the train split's top-k shards are coded: plain topk_shard/1, compact topk_shard/3 "
        "(the eval split is plain: format_of)",
    )
    engine: str = Field(
        "",
        description="what computes the rows (training.teacher.teacher_engine: numpy, or gpu/<backend>/<precision>): "
        "each writes its own bytes, so the plan's key folds it in and every shard is computed by it",
    )
    shards: tuple[ShardRecord, ...]

    @property
    def complete(self) -> bool:
        return all(s.complete for s in self.shards)

    def format_of(self, split: str) -> Literal["plain", "compact"]:
        """How split `split`'s shards are coded: topk_format for the train split's top-k shards; plain for sampled
        ones and the eval split (held-out metrics exact whatever the train store)."""
        return self.topk_format if split == "train" and self.store_of(split) == "topk" else "plain"

    def store_of(self, split: str) -> Literal["topk", "sampled"]:
        """The store of split `split`'s shards: `store`, except an eval split kept top-k (eval_k > 0)."""
        return "topk" if split == "eval" and self.eval_k else self.store

    def k_of(self, split: str) -> int:
        """Ids per position of split `split`'s shards (top-k width, or the sampled store's draws)."""
        return self.eval_k if split == "eval" and self.eval_k else self.k


class PrefixShard(Manifest):
    """One file of the frozen-prefix cache: float16 [n_seq, seq_len, hidden] of sequences [seq_start, seq_end)."""

    file: str = Field(description="file name inside the cache folder")
    split: Literal["train", "eval"]
    seq_start: int = Field(ge=0)
    seq_end: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256)
    bytes: int = Field(ge=0)


class PrefixManifest(Located):
    """Output of the prefix stage (dir: the cache folder): the residual stream entering block `layer` of the
    student (the frozen blocks 0..layer-1 applied to the tokens), one float16 row per position."""

    layer: int = Field(ge=1, description="the lowest adapted block: training starts its forward here")
    hidden: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    student_sha256: str = Field(pattern=SHA256)
    token_shards_hash: str = Field(pattern=SHA256, description="TokenizeManifest.shards_hash()")
    shards: tuple[PrefixShard, ...]

    def outputs(self) -> tuple[FileRef, ...]:
        """The shard files (placed manifests only)."""
        if not self.dir:
            return ()
        return tuple(FileRef(path=f"{self.dir}/{s.file}", sha256=s.sha256, bytes=s.bytes) for s in self.shards)


class CheckpointManifest(Located):
    """A saved training state (dir: the checkpoint folder): adapter + optimizer safetensors and a JSON with
    step, cursor, RNG, metrics."""

    epoch: int = Field(ge=0)
    step: int = Field(ge=0, description="optimizer steps taken so far")
    adapter: FileRef
    optimizer: FileRef
    state: FileRef
    metrics: dict[str, float] = Field(default_factory=dict)

    def outputs(self) -> tuple[FileRef, ...]:
        return (self.adapter, self.optimizer, self.state)


class CheckpointEval(Manifest):
    """What every evaluation names: the checkpoint's epoch and step (None: the student without adapter)."""

    epoch: int | None = Field(None, ge=0)
    step: int | None = Field(None, ge=0)


class EvalManifest(CheckpointEval):
    """Held-out metrics of one checkpoint (epoch/step None: the student before training)."""

    UNKEYED_DEFAULTS: ClassVar[dict[str, Any]] = {"ece": None, "ece_teacher": None}

    kl: float = Field(description="mean KL(teacher || student) per trained position")
    top1: float = Field(ge=0, le=1, description="fraction of positions where the argmaxes agree")
    ce: float = Field(description="mean cross-entropy on the true next token (nats)")
    ppl: float = Field(description="exp(ce)")
    n_positions: int = Field(ge=0)
    ece: float | None = Field(
        None,
        ge=0,
        le=1,
        description="expected calibration error of the student's top-1 probability against the true next token "
        "(model.metrics.Calibration); None: not reported by the engine (the GPU engine, for now)",
    )
    ece_teacher: float | None = Field(
        None,
        ge=0,
        le=1,
        description="the same against agreement with the teacher's top-1 (a student equal to its teacher scores "
        "1 - its mean top-1 probability, not 0: read it beside ece, not as a target)",
    )

    def metric(self, name: Literal["kl", "top1", "ce"]) -> float:
        """The value of a best_metric name."""
        return {"kl": self.kl, "top1": self.top1, "ce": self.ce}[name]


class ExportManifest(Located):
    """Files written from the best checkpoint (dir: the export folder)."""

    epoch: int = Field(ge=0)
    step: int = Field(ge=0)
    peft: tuple[FileRef, ...] | None = Field(None, description="adapter_model.safetensors and adapter_config.json")
    gguf_lora: FileRef | None = None
    merged: FileRef | None = None
    merge_report: dict[str, float] | None = Field(
        None,
        description="totals of the merge: merged tensors, error_rms, error_max, delta_rms, fold (1: a mergeable "
        "adapter folded exactly, 0: re-quantized), file_bytes and base_file_bytes (the merged and student GGUFs)",
    )

    def outputs(self) -> tuple[FileRef, ...]:
        return (*(self.peft or ()), *(ref for ref in (self.gguf_lora, self.merged) if ref is not None))

    def files(self) -> dict[str, str]:
        """What was written, as stored: peft_dir (the folder PEFT loads), gguf_lora, merged."""
        out = {}
        if self.peft:
            out["peft_dir"] = Path(self.peft[0].path).parent.as_posix()
        if self.gguf_lora is not None:
            out["gguf_lora"] = self.gguf_lora.path
        if self.merged is not None:
            out["merged"] = self.merged.path
        return out
