"""The numeric codes of compact top-k shards (topk_shard/3, teacher.topk_format compact; schemas.files
topk_compact_schema): log-probs as uint8 steps below the row's top-1, the top-1 and the tail as uint16 steps of
nats, and the ids' rank gaps as byte planes. Pure numpy; data/topk.py builds and reads the tables."""

from __future__ import annotations

import numpy as np

# d = top-1 log-prob - log-prob (nats) in segments (below `upto` nats, steps of `step`); codes clip at 255
SEGMENTS: tuple[tuple[float, float], ...] = ((2.0, 1 / 8), (4.0, 1 / 4), (7.0, 1 / 2), (np.inf, 1.0))
TOP_STEP = 1 / 256  # the row's top-1 log-prob: uint16 round(-top / TOP_STEP)
TAIL_STEP = 1 / 256  # the tail mass: uint16 round(-ln(tail) / TAIL_STEP); TAIL_ZERO codes 0
TAIL_ZERO = 65535
MAX_TOP_ERROR = TOP_STEP / 2


def _segments() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first nats, first code, step) of each segment."""
    lows = np.array([0.0] + [upto for upto, _ in SEGMENTS[:-1]])
    steps = np.array([step for _, step in SEGMENTS])
    widths = np.round(np.diff(np.append(lows, lows[-1])) / steps).astype(np.int64)  # the last segment's is unused
    first = np.concatenate([[0], np.cumsum(widths[:-1])])
    return lows, first, steps


LOWS, FIRST_CODES, STEPS = _segments()
MAX_CODED_NATS = float(LOWS[-1] + (255 - FIRST_CODES[-1]) * STEPS[-1])  # farther log-probs are clipped here


def max_logp_error(delta: np.ndarray) -> np.ndarray:
    """The stated error (nats) of a log-prob `delta` nats below its row's top-1 (within MAX_CODED_NATS): half the
    step of its segment plus the top-1's."""
    seg = np.searchsorted(LOWS, np.asarray(delta, np.float64), side="right") - 1
    return MAX_TOP_ERROR + STEPS[np.maximum(seg, 0)] / 2


def logp_codes(delta: np.ndarray) -> np.ndarray:
    """uint8 codes of delta = top-1 log-prob - log-prob (>= 0, nats), in SEGMENTS' steps; clipped at 255."""
    d = np.maximum(np.asarray(delta, np.float64), 0.0)
    seg = np.searchsorted(LOWS, d, side="right") - 1
    code = FIRST_CODES[seg] + np.round((d - LOWS[seg]) / STEPS[seg])
    # a value rounding up onto the next segment's first code is that code (same decoded value, within its step)
    return np.clip(code, 0, 255).astype(np.uint8)


def logp_deltas(codes: np.ndarray) -> np.ndarray:
    """The deltas (nats below the top-1, float32) of logp_codes' codes."""
    c = np.asarray(codes).astype(np.int64)
    seg = np.searchsorted(FIRST_CODES, c, side="right") - 1
    return (LOWS[seg] + (c - FIRST_CODES[seg]) * STEPS[seg]).astype(np.float32)


def top_codes(top: np.ndarray) -> np.ndarray:
    """uint16 codes of the rows' top-1 log-probs (<= 0; clipped at -65535 TOP_STEP)."""
    return np.clip(np.round(-np.asarray(top, np.float64) / TOP_STEP), 0, 65535).astype(np.uint16)


def top_values(codes: np.ndarray) -> np.ndarray:
    """The top-1 log-probs (float64) of top_codes' codes."""
    return -np.asarray(codes).astype(np.float64) * TOP_STEP


def tail_codes(tail: np.ndarray) -> np.ndarray:
    """uint16 codes of tail masses in [0, 1]: round(-ln(tail) / TAIL_STEP), TAIL_ZERO for 0 (and below
    exp(-65534 TAIL_STEP)); relative error within exp(TAIL_STEP / 2) - 1."""
    t = np.clip(np.asarray(tail, np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore"):
        code = np.round(-np.log(t) / TAIL_STEP)
    return np.where(code > TAIL_ZERO - 1, TAIL_ZERO, code).astype(np.uint16)


def tail_values(codes: np.ndarray) -> np.ndarray:
    """The tail masses (float32) of tail_codes' codes."""
    c = np.asarray(codes).astype(np.float64)
    return np.where(c == TAIL_ZERO, 0.0, np.exp(-c * TAIL_STEP)).astype(np.float32)


def gap_planes(gaps: np.ndarray, width: int) -> np.ndarray:
    """Rows of gaps [N, k] (0 <= gap < 256**width) as uint8 [N, width * k]: the k low bytes, then the next ..."""
    g = np.asarray(gaps, np.int64)
    return np.concatenate([((g >> (8 * b)) & 255).astype(np.uint8) for b in range(width)], axis=1)


def plane_gaps(planes: np.ndarray, width: int) -> np.ndarray:
    """The gaps [N, k] (int64) of gap_planes' rows [N, width * k]."""
    p = np.asarray(planes, np.uint8).astype(np.int64)
    k = p.shape[1] // width
    return sum(p[:, b * k : (b + 1) * k] << (8 * b) for b in range(width))
