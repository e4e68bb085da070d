"""Manifests of the preference-tuning stages (run.task: dpo) and the Parquet schema of the reference log-probs.

Like schemas/manifests.py: small, JSON-serialisable, paths relative to the workdir, files by size + sha256.
"""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from pydantic import Field

from schemas.manifests import SHA256, CheckpointEval, FileRef, Located

# Per pair of one split: the reference's summed response log-probs and the response token counts.
REFERENCE_SCHEMA = pa.schema(
    [
        ("split", pa.string()),
        ("pair_id", pa.int64()),
        ("chosen_logp", pa.float64()),
        ("rejected_logp", pa.float64()),
        ("chosen_tokens", pa.int32()),
        ("rejected_tokens", pa.int32()),
    ]
)


class PairsManifest(Located):
    """Output of the pairs stage (dir: its folder): tokenized preference pairs, train.parquet and eval.parquet."""

    dataset_fingerprint: str
    tokenizer_sha256: str = Field(pattern=SHA256, description="sha256 of the GGUF the tokenizer came from")
    seq_len: int = Field(ge=2, description="tokens per engine row: the longest stored row (<= data.seq_len)")
    train: FileRef
    eval: FileRef
    n_train: int = Field(ge=1)
    n_eval: int = Field(ge=1)
    dropped: int = Field(ge=0, description="pairs whose response had no token left within seq_len")

    def outputs(self) -> tuple[FileRef, ...]:
        return (self.train, self.eval)


class ReferenceManifest(Located):
    """Output of the reference stage (dir: its folder): reference.parquet (REFERENCE_SCHEMA), both splits."""

    reference_sha256: str = Field(pattern=SHA256, description="sha256 of the reference GGUF")
    reference: Literal["student", "file"] = Field(description="the student without adapter, or preference.reference")
    file: FileRef
    n_pairs: int = Field(ge=0)

    def outputs(self) -> tuple[FileRef, ...]:
        return (self.file,)


class PreferenceEvalManifest(CheckpointEval):
    """Held-out preference metrics of one checkpoint (epoch/step None: the student without adapter)."""

    loss: float = Field(description="mean preference loss over the held-out pairs")
    reward_accuracy: float = Field(ge=0, le=1, description="fraction of pairs whose chosen reward is higher")
    margin: float = Field(description="mean reward margin (chosen - rejected)")
    chosen_reward: float
    rejected_reward: float
    kl_reference: float = Field(description="mean KL(policy || reference) per response token (full vocabulary)")
    n_pairs: int = Field(ge=0)

    def metrics(self) -> dict[str, float]:
        """The metric values by name (for logging)."""
        return self.model_dump(exclude={"epoch", "step", "n_pairs"})
