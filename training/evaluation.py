"""Held-out evaluation above the engine interface: forward KL over the teacher top-k + tail, top-1 agreement, CE,
perplexity and the expected calibration errors of the student's top-1 (model.metrics.Calibration). The eval split's
shards are top-k in both teacher stores, so these are exact and comparable across stores."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from data.checkpoint import load_checkpoint
from model import reference
from model.engine_spec import KdBatch
from model.metrics import Calibration
from schemas.config import RunConfig
from training import engines
from training.batches import KdSource, Split, read_split
from training.engine import AdapterLayout


# ---- evaluation -------------------------------------------------------------------------------------------
def zero_adapter(layout: AdapterLayout) -> dict[tuple[int, str], reference.LoraPair]:
    """A and B all zero in every slot: the student as it is (the baseline)."""
    return {
        key: reference.LoraPair(np.zeros((layout.r, s.d_in), np.float32), np.zeros((s.d_out, layout.r), np.float32))
        for key, s in layout.slots.items()
    }


def teacher_top1(batch: KdBatch, width: int) -> np.ndarray:
    """The teacher's top-1 id per position [B * T]: its first top-k id, or for the sampled store the most drawn id
    (ties: the smallest), the estimate the draws give."""
    ids = np.asarray(batch.teacher_ids).reshape(-1, width)
    if batch.teacher_counts is None:
        return ids[:, 0]
    best = np.argmax(np.asarray(batch.teacher_counts).reshape(-1, width), axis=1)  # ids ascend: first = smallest
    return ids[np.arange(len(ids)), best]


def eval_batches(cfg: RunConfig, split: Split) -> Iterator[np.ndarray]:
    b = cfg.train.batch_size
    n_batches = math.ceil(len(split.seq_ids) / b)
    if cfg.eval.eval_batches:
        n_batches = min(n_batches, cfg.eval.eval_batches)
    for i in range(n_batches):
        yield np.arange(i * b, min((i + 1) * b, len(split.seq_ids)))


def evaluate(
    cfg: RunConfig,
    *,
    student_gguf: Path,
    token_dir: Path,
    topk_dir: Path,
    checkpoint: Path | None,
    prefix_dir: Path | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> dict[str, float | None]:
    """Held-out forward KL(teacher || student) over the top-k + tail, top-1 agreement, CE, perplexity and the
    expected calibration error of the student's top-1 probability: ece against the true next token (the usual
    calibration), ece_teacher against agreement with the teacher's top-1 (not 0 for a student equal to its teacher:
    1 - its mean top-1 probability); both None from an engine that does not report its top-1 log-prob.

    checkpoint None evaluates the student without an adapter (the baseline). prefix_dir: a frozen-prefix cache
    (the engine starts at its block). on_batch(n_sequences) after each batch (progress)."""
    split = read_split(token_dir, "eval")
    if len(split.seq_ids) == 0:
        raise ValueError(f"{token_dir}: the eval split is empty (raise data.eval_fraction)")
    source = KdSource.open(split, topk_dir, prefix_dir)
    engine = engines.build_engine(cfg, student_gguf, split.seq_len, eval_mode=True, start_layer=source.start_layer)
    engine.set_adapter(zero_adapter(engine.layout) if checkpoint is None else load_checkpoint(checkpoint)[0])
    tau2 = cfg.teacher.temperature**2
    width = source.reader.manifest.k_of("eval")
    if width != engines.teacher_width(cfg, "eval"):
        raise ValueError(f"{topk_dir}: eval shards of width {width}, the run's evaluation expects "
                         f"{engines.teacher_width(cfg, 'eval')} (teacher.top_k)")  # fmt: skip
    kl_sum = ce_sum = top1 = n = 0.0
    # the student's top-1 confidence against the true next token, and against the teacher's top-1
    calibration: tuple[Calibration, Calibration] | None = (Calibration(), Calibration())
    for rows in eval_batches(cfg, split):
        batch = source.batch(rows, cfg.train.batch_size, width)
        engine.write_batch(batch)
        out = engine.evaluate_batch()
        m = batch.mask.reshape(-1) != 0
        count = int(m.sum())
        kl_sum += float(out["kd_loss"][0]) * count / tau2
        ce_sum += float(out["ce"][m].sum())
        agree = out["top1"][m] == teacher_top1(batch, width)[m]
        top1 += float(agree.sum())
        if calibration is not None and "top1_logp" in out:
            calibration[0].add(out["top1_logp"][m], out["top1"][m] == batch.targets.reshape(-1)[m])
            calibration[1].add(out["top1_logp"][m], agree)
        else:
            calibration = None
        n += count
        if on_batch is not None:
            on_batch(len(rows))
    if n == 0:
        raise ValueError(f"{token_dir}: the eval split has no trained positions")
    ce = ce_sum / n
    ece, ece_teacher = (None, None) if calibration is None else (c.ece() for c in calibration)
    ppl = float(math.exp(min(ce, 50.0)))
    return {
        "kl": kl_sum / n,
        "top1": top1 / n,
        "ce": ce,
        "ppl": ppl,
        "tokens": n,
        "ece": ece,
        "ece_teacher": ece_teacher,
    }
