"""The run config: one pydantic model, also the Prefect deployment parameter schema.

Every field has a description (the Prefect run form shows it) and `extra="forbid"` makes a typo an error.
`load_config` reads YAML/JSON plus `key.sub=value` overrides and turns validation errors into one readable
line per bad field; `config_fingerprint` hashes selected fields for stage cache keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the source and every bad field."""


# Duplicated from model.config.LORA_TARGETS (schemas may not import model/); a test keeps them in sync.
LoraTarget = Literal["q", "k", "v", "o", "gate", "up", "down"]
LORA_TARGET_NAMES: tuple[str, ...] = get_args(LoraTarget)

# GGUF tensor types we can write: gguf-py's encoders plus our own K-quant encoders (Q4_K, Q6_K).
QuantName = Literal["F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0"]
QUANT_NAMES: tuple[str, ...] = get_args(QuantName)


def _quant_list(value: Any) -> Any:
    """Accept "Q4_K", "q4_k,q4_0" or a list; upper-case the names."""
    if isinstance(value, str):
        value = [part for part in value.replace("/", ",").split(",") if part.strip()]
    if isinstance(value, list | tuple):
        return tuple(v.strip().upper() if isinstance(v, str) else v for v in value)
    return value


def _check_quant_list(value: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not value:
        raise ValueError("give at least one quant type, or null")
    if len(set(value)) != len(value):
        raise ValueError("duplicate quant type")
    return value


QuantList = Annotated[tuple[QuantName, ...] | None, BeforeValidator(_quant_list), AfterValidator(_check_quant_list)]

_NOT_IN_A_NAME = re.compile(r"[/\\\x00-\x1f\x7f]")


def _check_file_name(value: str | None) -> str | None:
    """A name that becomes a file name under the workdir: one path component, never a path."""
    if value is None:
        return None
    if value.strip() in ("", ".", "..") or _NOT_IN_A_NAME.search(value) or len(value) > 200:
        raise ValueError(
            "must be a plain name, not a path (no '/', '\\' or control characters, not '.' or '..', at most 200 "
            "characters): it names files under <workdir>/reports"
        )
    return value


FileName = Annotated[str | None, AfterValidator(_check_file_name)]


def _kept_blocks(value: Any) -> Any:
    """train.kept_blocks: a number of blocks >= 0 (digits from --set too) or "auto", one error line otherwise."""
    if value == "auto" or (type(value) is int and value >= 0):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise ValueError("expected a number of blocks >= 0 or 'auto'")


KeptBlocks = Annotated[int | Literal["auto"], BeforeValidator(_kept_blocks)]


def _admits(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field's annotation is one of `kinds`, or one of them or None; never when it admits bool."""
    options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return bool not in options and any(option in kinds for option in options)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, defaults are validated, no inf/nan."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _scalars_as_meant(cls, value: Any, info: ValidationInfo) -> Any:
        """A boolean is not a number (pydantic would read true as 1); an integer where a string is expected is
        that string (experiment: 2024)."""
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        if isinstance(value, bool) and _admits(annotation, (int, float)):
            raise ValueError("a boolean where a number is expected")
        if type(value) is int and _admits(annotation, (str,)):
            return str(value)
        return value


class ModelSection(Section):
    """Which GGUF files to distil between."""

    student: Path = Field(
        description="Student GGUF: the model that gets the LoRA adapter. May be an F32/F16 file, quantized "
        "by student_quant, or an already-quantized file used as is."
    )
    teacher: Path = Field(
        description="Teacher GGUF, same tokenizer as the student (usually the full-precision model, or a "
        "larger model of the same family)."
    )
    student_quant: QuantList = Field(
        None,
        description="null: use the student file as is. Otherwise GGUF types in order of preference: each 2-D "
        "weight gets the first type its row length allows, e.g. [Q4_K, Q4_0] gives Q4_K where the row length "
        "is a multiple of 256 and Q4_0 elsewhere. Norms and other 1-D tensors stay F32.",
    )


class DataSection(Section):
    """Training text and how it becomes fixed-length token sequences."""

    path: Path = Field(description="Training data: a file, or a directory of files of one format.")
    eval_path: Path | None = Field(
        None,
        description="Held-out data in the same format as path: when set, every document of path trains, every "
        "document of eval_path is held out, and eval_fraction is not used (a split by source, e.g. other books "
        "than the training ones, so no held-out text overlaps the training text). null: hold out eval_fraction "
        "of path's documents. Refused when it names path's files (held-out metrics would be training metrics).",
    )
    format: Literal["auto", "jsonl", "json", "parquet", "text", "hf_dir"] = Field(
        "auto",
        description="auto: by file extension (.jsonl, .json, .parquet, .txt), or hf_dir for a directory "
        "written by datasets' save_to_disk.",
    )
    text_field: str = Field("text", min_length=1, description="Record field holding plain text.")
    messages_field: str = Field(
        "messages",
        min_length=1,
        description="Record field holding a chat ([{role, content}, ...]), rendered with the model's chat "
        "template. Used when a record has it; otherwise text_field is used.",
    )
    assistant_only: bool = Field(
        True, description="For chat records, train only on assistant tokens (the prompt is masked out)."
    )
    seq_len: int = Field(512, ge=2, le=131072, description="Tokens per training sequence.")
    eval_fraction: float = Field(
        0.05,
        gt=0.0,
        lt=1.0,
        description="Fraction of documents held out for evaluation (chosen deterministically by document, "
        "before packing, so no document is in both splits). Not used when eval_path is set.",
    )
    max_documents: int | None = Field(
        None, ge=1, description="Use only the first N documents (null: all). Handy for smoke runs."
    )
    pack: bool = Field(
        True,
        description="Pack documents end to end (EOS between) into full seq_len sequences. false: one "
        "document per sequence, truncated to seq_len and padded (padding is masked out of the loss).",
    )


class TeacherSection(Section):
    """How the teacher's next-token distributions are precomputed and stored."""

    store: Literal["topk", "sampled"] = Field(
        "topk",
        description="What the teacher stage stores per position: topk (the top_k most probable ids and their "
        "log-probs, plus the tail mass) or sampled (the distinct ids of `samples` draws from the teacher at "
        "temperature, with their counts: an unbiased estimate of the full-vocabulary forward KL; loss.kind "
        "forward_kl only; docs/architecture.md).",
    )
    top_k: int = Field(128, ge=1, le=256, description="Teacher token ids kept per position (by probability).")
    samples: int = Field(
        12, ge=1, le=255, description="Draws per position of the sampled store (teacher.store sampled only)."
    )
    seed: int = Field(
        0, ge=0, lt=2**64, description="Seed of the sampled store's draws (keyed by seed, sequence and position)."
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="Temperature tau at which the teacher's log-probabilities are stored (part of the "
        "teacher cache key). Must equal loss.temperature: the loss uses the stored values as they are.",
    )
    tail: bool = Field(
        True,
        description="Use the tail bucket in the loss: the teacher mass outside the top-k ids (always stored) "
        "is compared with the student's mass outside the same ids. false: the loss sees the k ids only, the "
        "teacher renormalised over them.",
    )
    shard_tokens: int = Field(
        65536, ge=1, description="Target positions per top-k shard (a shard holds whole sequences)."
    )
    topk_format: Literal["plain", "compact"] = Field(
        "plain",
        description="How the train split's top-k shards are coded: plain (topk_shard/1: ids and float16 log-probs) "
        "or compact (topk_shard/3: ids as gaps of their ranks in a per-shard dictionary, log-probs as byte codes "
        "below the row's top-1, max error 1/16 nat within 2 nats of it, 1/8 within 4, 1/4 within 7, 1/2 further; "
        "about half the bytes; docs/architecture.md). The eval split stays plain, so held-out metrics are exact. "
        "Part of the teacher key when compact. The Ray runner writes plain shards only.",
    )
    backend: Literal["auto", "numpy", "gpu"] = Field(
        "auto",
        description="Where the teacher forward runs: gpu (wgpu kernels), numpy (BLAS; faster than a CPU "
        "Vulkan adapter such as lavapipe), auto (numpy when the only adapter is a CPU, else gpu).",
    )
    runner: Literal["local", "ray"] = Field(
        "local",
        description="Who computes the planned shards: local (this process, one shard after another) or ray (the "
        "missing shards as Ray tasks on the cluster of scale.ray_address, one GPU each where the cluster has "
        "GPUs, else one CPU). The shards are byte-identical either way, so the runner is not in the cache key.",
    )


class LossSection(Section):
    """The distillation loss on positions with loss_mask = 1."""

    kind: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl",
        description="forward_kl: KL(p_T || p_S) (mode covering); reverse_kl: KL(p_S || p_T) (mode seeking); "
        "jsd: generalized Jensen-Shannon with weight beta.",
    )
    beta: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="JSD weight (kind=jsd only, then strictly between 0 and 1): M = beta*p_T + (1-beta)*p_S, "
        "loss = beta*KL(p_T || M) + (1-beta)*KL(p_S || M).",
    )
    ce_weight: float = Field(
        0.0, ge=0.0, description="Weight of an added cross-entropy loss on the true next token (0: pure KD)."
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="KD temperature tau: the student logits are divided by tau and the KD term is scaled by "
        "tau^2. Must equal teacher.temperature (the teacher's log-probs are stored at it).",
    )

    @field_validator("beta")
    @classmethod
    def _jsd_beta_inside(cls, value: float, info: ValidationInfo) -> float:
        if info.data.get("kind") == "jsd" and not 0.0 < value < 1.0:
            raise ValueError("must be strictly between 0 and 1 for kind=jsd (at 0 or 1 the JSD vanishes)")
        return value


# The input-dimension group of a mergeable adapter: the block of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the sub-block of
# Q4_K/Q5_K, each of which carries one scale (and offset) per 32 inputs (model.quant.QK; a test keeps them equal).
MERGE_GROUP = 32


def lora_scale(alpha: float, r: int) -> float:
    """The factor on a LoRA adapter's output, alpha / r (PEFT's convention): the one place it is computed."""
    return alpha / r


class LoraSection(Section):
    """LoRA adapters (PEFT convention: y = x W^T + (alpha/r) (x A^T) B^T; A Kaiming-uniform, B zero)."""

    # No dropout field on purpose: dropout would need a per-step random mask on the GPU, and runs are meant to
    # be bitwise reproducible (that is what makes bit-exact resume possible). KD targets regularise enough.
    r: int = Field(16, ge=1, le=4096, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0.0, description="LoRA alpha; the update is scaled by alpha / r.")
    targets: tuple[LoraTarget, ...] = Field(
        LORA_TARGET_NAMES,
        description="Projections that get an adapter in every block: q, k, v, o (attention) and gate, up, "
        "down (MLP). Also accepts 'all' or a comma-separated string. Stored in that canonical order.",
    )
    layers: tuple[int, ...] | None = Field(
        None,
        description="Blocks that get adapters (PEFT layers_to_transform), e.g. [20, 21, ...]; null: all. "
        "The backward stops at the lowest adapted block, so adapting only the top blocks trains faster.",
    )
    kind: Literal["plain", "mergeable"] = Field(
        "plain",
        description="plain: ordinary LoRA. mergeable (QA-LoRA with sum pooling): A is constant over each group of "
        "32 inputs (the student's quantization blocks), so B A adds one value per block and folds exactly into "
        "the blocks' offsets at merge time (export.merge keeps the adapter's gain in a 4-bit file). Needs every "
        "adapted projection's input size to be a multiple of 32. Exports stay ordinary LoRA files.",
    )

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not value or min(value) < 0 or len(set(value)) != len(value):
            raise ValueError("give distinct block indices >= 0, or null for all blocks")
        return tuple(sorted(value))

    @field_validator("targets", mode="before")
    @classmethod
    def _split_targets(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value.strip().lower() == "all":
                return LORA_TARGET_NAMES
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("targets")
    @classmethod
    def _canonical_targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("give at least one target")
        if len(set(value)) != len(value):
            raise ValueError("duplicate target")
        return tuple(t for t in LORA_TARGET_NAMES if t in value)

    @property
    def scale(self) -> float:
        """alpha / r, the factor on the adapter's output."""
        return lora_scale(self.alpha, self.r)

    @property
    def group(self) -> int:
        """Inputs per constant group of A: MERGE_GROUP for a mergeable adapter, 0 for plain LoRA."""
        return MERGE_GROUP if self.kind == "mergeable" else 0


class OptimSection(Section):
    """AdamW (decoupled weight decay) with a warmup + decay schedule."""

    lr: float = Field(2e-4, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled (AdamW) weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon.")
    warmup_steps: int = Field(5, ge=0, description="Optimizer steps of linear warmup from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup, down to min_lr_ratio * lr at the last step."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Final learning rate as a fraction of lr (cosine/linear)."
    )
    grad_clip: float = Field(1.0, ge=0.0, description="Clip the global gradient norm to this value (0: no clipping).")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("each beta must be in [0, 1)")
        return value


class TrainSection(Section):
    """Training loop."""

    # Upper bounds: a typo such as 11111111111111111111 is refused here, not a run that never ends (one task per
    # epoch, one forward and backward per micro-batch) or a batch array no memory holds.
    epochs: int = Field(3, ge=1, le=10_000, description="Passes over the training split; a checkpoint after each.")
    batch_size: int = Field(8, ge=1, le=65_536, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, ge=1, le=1024, description="Micro-batches accumulated per optimizer step.")
    checkpoint_every: int = Field(
        0, ge=0, description="Also checkpoint every N optimizer steps (0: only at the end of each epoch)."
    )
    seed: int = Field(0, ge=0, description="Seed of LoRA init and data order; a run is reproducible from it.")
    precision: Literal["f32", "tensorcore", "int8", "auto"] = Field(
        "auto",
        description="Matmul path: f32 (portable, strict parity with the reference); tensorcore (f16 operands "
        "in subgroup matrices, f32 accumulation); int8 (the frozen projections' GEMMs on integer subgroup "
        "matrices, 8-bit activations and weights with per-row scales after a Walsh-Hadamard rotation: the "
        "demo's held-out KL within 1 % of tensorcore's, evaluated on the tensor cores: eval.precision; README "
        "Numerics); auto: the student trains in int8 where the GPU has integer subgroup matrices, else "
        "tensorcore where it has f16 ones, else f32 (the teacher's top-k, the frozen-prefix cache and preference "
        "training take tensorcore, else f32).",
    )
    kept_blocks: KeptBlocks = Field(
        "auto",
        description="GPU engine, memory for speed: blocks whose intermediates the forward keeps so the backward "
        "does not recompute them (gradient checkpointing off for those blocks). Each costs 4 bytes a token per "
        "float of its q, k, v, attention output, residual, gate and up outputs (Llama-3-8B: 172 KB a token, "
        "0.71 GB a block at 4 x 1,024 tokens); a recomputed block repeats its q/k/v, o and gate/up GEMMs and its "
        "attention. 0: recompute every block (least memory); N: the top N of the blocks a backward recomputes; "
        "auto: as many as fit in the GPU's memory (where the driver reports it; else 0). Not used by the numpy "
        "engine, which keeps every block's intermediates when they fit in 2 GiB.",
    )
    int8_codes: Literal["auto", "resident", "per_block"] = Field(
        "auto",
        description="precision int8, memory for speed: resident decodes the frozen projections' int8 codes once and "
        "keeps them (a byte a weight: 7.0 GB at Llama-3-8B) for the student's and the teacher's forwards and the "
        "backward; per_block decodes one block's at a time whenever a pass needs it (the least memory; ~6 % of "
        "the Llama-3-8B step); auto: resident where they fit in the GPU's memory (as train.kept_blocks, which "
        "gets what is left), else per_block.",
    )
    backend: Literal["auto", "gpu", "numpy"] = Field(
        "auto",
        description="The engine that trains and evaluates: gpu (wgpu kernels on Vulkan/Metal/DX12; on a CPU-only "
        "machine they run on lavapipe at ~10 GFLOP/s), numpy (float32 numpy through BLAS, the same math and "
        "checkpoints; ~15x faster than lavapipe on 2 cores: bench/cpu_train_step.py), auto (numpy when the only "
        "adapter is a CPU or there is none, else gpu). The choice and its reason are logged.",
    )
    prefix_cache: Literal["auto", "off"] = Field(
        "auto",
        description="Frozen-prefix activation cache. When lora.layers leaves out the lowest blocks, the residual "
        "stream entering the lowest adapted block L depends only on the tokens: auto computes it once per "
        "sequence (stored as float16, verified by sha256) and every training step and evaluation starts the "
        "forward at block L, so blocks 0..L-1 cost nothing after the first pass. off: always run the whole "
        "forward (bitwise the same numbers as before the cache; the cache rounds block L's input to float16).",
    )
    max_steps_per_epoch: int | None = Field(
        None, ge=1, description="Cut each epoch after N optimizer steps (null: the whole split)."
    )
    workers: int = Field(
        1,
        ge=1,
        description="Data-parallel workers: 1 trains in this process; N > 1 trains on N Ray actors (scale."
        "ray_address), each with its own engine, each taking whole micro-batches of every step (so N must not "
        "exceed grad_accum); their gradients are summed in micro-batch order and every worker takes the same "
        "AdamW step. The result equals the 1-worker run (bitwise on numpy and the f32 GPU path), so workers is "
        "not in the cache key and checkpoints resume with any N.",
    )

    @property
    def sequences_per_step(self) -> int:
        """Sequences contributing to one optimizer step."""
        return self.batch_size * self.grad_accum


class EvalSection(Section):
    """Held-out evaluation after each epoch and best-checkpoint selection."""

    best_metric: Literal["kl", "top1", "ce"] = Field(
        "kl",
        description="Metric that picks the best checkpoint: kl (held-out KL(teacher || student), lower is "
        "better), top1 (agreement of argmaxes, higher is better), ce (cross-entropy, lower is better).",
    )
    eval_batches: int | None = Field(
        None, ge=1, description="Evaluate on the first N batches of the held-out split (null: all of it)."
    )
    precision: Literal["auto", "train", "f32", "tensorcore", "int8"] = Field(
        "auto",
        description="Matmul path of the held-out evaluation (as train.precision's values): train: the training's "
        "(auto as the student resolved it); auto: the training's, except that int8 training, also auto's, is "
        "evaluated on the f16 tensor cores (int8 is a training speed choice: its 8-bit activations round the "
        "held-out forward itself, the demo's KL +2 % with no loss in the trained adapter; README Numerics).",
    )

    @property
    def higher_is_better(self) -> bool:
        """Direction of best_metric."""
        return self.best_metric == "top1"


class ExportSection(Section):
    """What to write from the best checkpoint."""

    peft: bool = Field(True, description="Write a PEFT adapter dir (adapter_model.safetensors + config).")
    gguf_lora: bool = Field(True, description="Write a GGUF LoRA adapter (llama.cpp --lora).")
    merge: bool = Field(False, description="Write the student with the adapter merged in as a new GGUF.")
    merge_quant: QuantList = Field(
        None,
        description="Types for the merged GGUF's 2-D weights, in order of preference as in "
        "model.student_quant (null: each tensor keeps the student's type). Needs merge=true.",
    )


class PreferenceSection(Section):
    """Preference tuning (run.task: dpo): pairs of a prompt with a chosen and a rejected response."""

    beta: float = Field(
        0.1, gt=0.0, description="Reward scale beta: reward = beta * (log pi(y) - log pi_ref(y)) summed over y."
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid",
        description="sigmoid: DPO, -log sigmoid(margin); ipo: (u - 1/(2 beta))^2 with u = margin / beta; "
        "hinge: max(0, 1 - margin).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="Conservative DPO: the probability that a pair's labels are flipped (loss_type sigmoid only).",
    )
    reference_free: bool = Field(
        False,
        description="SimPO form: no reference model; log-probs averaged over the response tokens, margin "
        "beta * (mean log pi(chosen) - mean log pi(rejected)) - gamma. The reference stage is skipped.",
    )
    gamma: float = Field(0.0, ge=0.0, description="SimPO target margin (reference_free only).")
    reference: Path | None = Field(
        None,
        description="Reference GGUF with the student's vocabulary (null: the student itself without an adapter, "
        "the usual DPO reference).",
    )
    prompt_field: str = Field(
        "prompt", min_length=1, description="Record field of the prompt: a string (one user turn) or a chat."
    )
    chosen_field: str = Field(
        "chosen", min_length=1, description="Record field of the preferred response (a string or assistant turns)."
    )
    rejected_field: str = Field("rejected", min_length=1, description="Record field of the dispreferred response.")

    @model_validator(mode="after")
    def _variant_fields(self) -> PreferenceSection:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"label_smoothing applies to loss_type sigmoid only (loss_type is {self.loss_type})")
        if self.gamma and not self.reference_free:
            raise ValueError("gamma is the SimPO margin: set reference_free=true, or gamma=0")
        return self


class ScaleSection(Section):
    """Scale-out on Ray (teacher.runner: ray, train.workers > 1); nothing here changes results."""

    ray_address: str = Field(
        "auto",
        min_length=1,
        description="The Ray cluster: auto (the cluster this process is already connected to, else the one "
        "RAY_ADDRESS or a running local head names, else a new local one), local (always a new local one), or an "
        "address such as ray://head:10001 or head:6379. The run's workdir and GGUF files must be visible at the "
        "same paths on every node (a shared filesystem).",
    )
    gpus_per_worker: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="GPUs a teacher task or training worker asks Ray for where the cluster has GPUs: 1 gives each "
        "its own GPU; 0.5 puts two workers, each with its own device, on one GPU.",
    )


class RunSection(Section):
    """Where the run writes and how it is tracked."""

    workdir: Path = Field(Path("runs/default"), description="Directory for every artifact and cache of this run.")
    experiment: str = Field("distillery", min_length=1, description="MLflow experiment name.")
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI, e.g. http://127.0.0.1:5000 from infra/up.sh (null: $MLFLOW_TRACKING_URI "
        "when set, else sqlite:///<workdir>/mlflow.db with artifacts under workdir).",
    )
    run_name: FileName = Field(
        None,
        description="MLflow / Prefect run name (null: generated); also the report's file name "
        "(<workdir>/reports/<run_name>.md), so a plain name, not a path.",
    )
    task: Literal["distill", "dpo"] = Field(
        "distill",
        description="distill: teacher -> student knowledge distillation. dpo: preference tuning of the student's "
        "adapter on (prompt, chosen, rejected) pairs from data.path (the preference section; model.teacher is "
        "not read and defaults to model.student).",
    )
    gpu_backend: Literal["auto", "wgpu", "dawn"] = Field(
        "auto",
        description="wgpu-py backend: wgpu (wgpu-native: Vulkan/Metal/DX12, lavapipe on a CPU), dawn (tensor "
        "cores through subgroup matrices), auto (dawn when it offers subgroup matrices, else wgpu).",
    )

    def tracking_uri(self) -> str:
        """mlflow_uri, else $MLFLOW_TRACKING_URI (how a served worker is pointed at a team server), else the
        sqlite database under workdir."""
        if self.mlflow_uri:
            return self.mlflow_uri
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        return f"sqlite:///{(self.workdir / 'mlflow.db').resolve()}"


class RunConfig(Section):
    """A whole distillation run."""

    model: ModelSection = Field(description="Student and teacher GGUF files.")
    data: DataSection = Field(description="Training data and tokenization.")
    teacher: TeacherSection = Field(default_factory=TeacherSection, description="Teacher top-k precompute.")
    loss: LossSection = Field(default_factory=LossSection, description="Distillation loss.")
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA adapters.")
    optim: OptimSection = Field(default_factory=OptimSection, description="Optimizer and LR schedule.")
    train: TrainSection = Field(default_factory=TrainSection, description="Epochs, batching, checkpoints, precision.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Held-out evaluation.")
    export: ExportSection = Field(default_factory=ExportSection, description="Export formats.")
    run: RunSection = Field(default_factory=RunSection, description="Output directory and tracking.")
    scale: ScaleSection = Field(default_factory=ScaleSection, description="Ray cluster for scale-out.")
    preference: PreferenceSection = Field(
        default_factory=PreferenceSection, description="Preference tuning (run.task: dpo)."
    )

    @model_validator(mode="before")
    @classmethod
    def _dpo_needs_no_teacher(cls, data: Any) -> Any:
        run = data.get("run") if isinstance(data, dict) else None
        if not isinstance(run, dict) or run.get("task") != "dpo":
            return data
        model = data.get("model")
        if isinstance(model, dict) and "teacher" not in model and "student" in model:
            data = {**data, "model": {**model, "teacher": model["student"]}}
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        if self.export.merge_quant is not None and not self.export.merge:
            raise ValueError("export.merge_quant: set, but export.merge is false (set export.merge=true)")
        if self.train.workers > self.train.grad_accum:
            raise ValueError(
                f"train.workers: {self.train.workers} exceeds train.grad_accum {self.train.grad_accum}; each worker "
                "takes whole micro-batches of a step: raise train.grad_accum (or lower train.batch_size with it)"
            )
        if self.teacher.store == "sampled" and self.loss.kind != "forward_kl":
            raise ValueError(
                f"loss.kind: {self.loss.kind} needs the teacher's top-k; teacher.store: sampled holds draws, which "
                "estimate forward_kl only (set loss.kind: forward_kl or teacher.store: topk)"
            )
        if self.teacher.topk_format == "compact" and self.teacher.runner == "ray":
            raise ValueError(
                "teacher.runner: ray writes plain top-k shards only (set teacher.topk_format: plain or "
                "teacher.runner: local)"
            )
        if self.loss.temperature != self.teacher.temperature:
            raise ValueError(
                f"loss.temperature: {self.loss.temperature} differs from teacher.temperature "
                f"{self.teacher.temperature}; set both (the teacher's log-probs are stored at it)"
            )
        return self


# ---------------------------------------------------------------------------------------------- loading


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping of a config (YAML or JSON keeps the last one silently)."""


class _StrictLoader(yaml.SafeLoader):
    """YAML 1.2's core schema (booleans are true/false only, so yes/no/on/off and dates stay strings; ints
    decimal, 0o octal or 0x hex) that refuses a key given twice in one mapping."""

    yaml_implicit_resolvers: dict[str, list[tuple[str, re.Pattern[str]]]] = {}

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                if key_node.value in seen:
                    raise DuplicateKey(
                        f"line {line}: duplicate key '{key_node.value}' (first at line {seen[key_node.value]}); "
                        "a key may appear once in a section"
                    )
                seen[key_node.value] = line
        return super().construct_mapping(node, deep)

    def construct_core_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node))
        return int(text, 0) if text.lstrip("+-")[:2] in ("0x", "0o") else int(text, 10)


for _tag, _pattern, _first in (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
    ("merge", r"^(?:<<)$", "<"),
):
    _StrictLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_core_int)


def parse_yaml(text: str) -> Any:
    """YAML text read with the 1.2 core schema, duplicate keys refused (DuplicateKey, a yaml.YAMLError)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook: a key given twice is DuplicateKey."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"duplicate key '{key}'; a key may appear once in a section")
        out[key] = value
    return out


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = parse_yaml(text)
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            raise ConfigError(f"{path}: unknown config format {suffix!r} (use .yaml, .yml or .json)")
    except DuplicateKey as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot parse: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _section_class(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    annotation = model.model_fields[name].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _check_key(key: str, item: str) -> list[str]:
    """Split a dotted key and check every part names a field; raise naming the valid keys otherwise."""
    parts = key.split(".")
    model: type[BaseModel] | None = RunConfig
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "top level"
        if model is None:
            raise ConfigError(f"--set {item}: '{'.'.join(parts[:i])}' is a value, not a section")
        if part not in model.model_fields:
            valid = ", ".join(model.model_fields)
            raise ConfigError(f"--set {item}: unknown key '{key}' (valid keys of {where}: {valid})")
        model = _section_class(model, part)
    return parts


def _apply_override(data: dict[str, Any], item: str) -> str:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item}: expected key.sub=value, e.g. lora.r=8")
    parts = _check_key(key, item)
    try:
        value = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item}: cannot parse value: {' '.join(str(exc).split())}") from None
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item}: '{'.'.join(parts[: i + 1])}' is not a mapping in the config")
        node = child
    node[parts[-1]] = value
    return key


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _format_errors(exc: ValidationError, source: str, overridden: dict[str, str]) -> str:
    lines = []
    for err in exc.errors():
        loc = _loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parent = _parent_model(err["loc"][:-1])
            valid = ", ".join(parent.model_fields) if parent else "?"
            msg = f"unknown key (valid keys here: {valid})"
        elif err["loc"] and err["type"] != "missing" and "input" in err:
            got = repr(err["input"])
            msg += f" (got {got if len(got) <= 60 else got[:57] + '...'})"
        key = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))
        hits = [v for k, v in overridden.items() if key == k or key.startswith(k + ".")]
        via = f" [--set {hits[-1]}]" if hits else ""
        lines.append(f"  {loc}: {msg}{via}" if loc else f"  {msg}")
    return f"invalid config {source}:\n" + "\n".join(lines)


def _parent_model(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = RunConfig
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _section_class(model, part)
    return model


def _path_fields() -> list[tuple[str, str]]:
    """(section, field) of every config field that names a file or folder."""
    found = []
    for section in RunConfig.model_fields:
        fields = getattr(_section_class(RunConfig, section), "model_fields", {})
        found += [(section, name) for name, f in fields.items() if _admits(f.annotation, (Path,))]
    return found


def _anchor_paths(data: dict[str, Any], base: Path) -> None:
    """Make the relative paths of a config file's path fields absolute, relative to the file's folder `base`."""
    for section, name in _path_fields():
        node = data.get(section)
        value = node.get(name) if isinstance(node, dict) else None
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            node[name] = os.path.normpath(base.absolute() / value)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML/JSON config (None: start from defaults), apply `key.sub=value` overrides, validate.

    YAML is read with the 1.2 core schema (yes/no/on/off and dates are strings) and a key given twice is an
    error. Relative paths in the file are relative to the file's folder; in an override, to the current
    directory. Override values are parsed as YAML scalars/lists ("8" -> 8, "[q,v]" -> list, "null" -> None).
    Raises ConfigError with one line per bad field, naming the source file and any override responsible.
    """
    data = _read_file(Path(path)) if path is not None else {}
    if path is not None:
        _anchor_paths(data, Path(path).parent)
    source = str(path) if path is not None else "(no file)"
    overridden: dict[str, str] = {}
    for item in overrides:
        overridden[_apply_override(data, item)] = item
    _anchor_paths(data, Path.cwd())  # the overrides' relative paths (the file's are absolute by now)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source, overridden)) from None


def dump_config(cfg: RunConfig) -> str:
    """The config as YAML (every field, defaults included, paths absolute); load_config reads it back unchanged
    from any folder."""
    data = cfg.model_dump(mode="json")
    _anchor_paths(data, Path.cwd())
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def config_fingerprint(cfg: RunConfig, fields: Iterable[str]) -> str:
    """sha256 hex over canonical JSON of the selected dotted fields (e.g. "lora", "teacher.top_k").

    For stage cache keys. Select values, not paths: file contents enter cache keys through their sha256.
    """
    dumped = cfg.model_dump(mode="json")
    selected: dict[str, Any] = {}
    for name in fields:
        node: Any = dumped
        for part in name.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"config_fingerprint: unknown config field '{name}'")
            node = node[part]
        selected[name] = node
    canonical = json.dumps(selected, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
