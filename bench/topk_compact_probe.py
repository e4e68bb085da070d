"""How small a compact top-k shard could be, as JSON (issue 26 item 3, a probe: nothing here is a store yet).

    python bench/topk_compact_probe.py <workdir>/teacher/<key>      # a top-k teacher folder (topk_shard/1)

Re-encodes the train split's top-k shards in memory with the same Parquet writer (zstd level 7) and prints bytes
per position for: /1 as written; ids sorted and delta-coded (uint16 gaps; and the gaps split into high and low
bytes), log-probs as uint8 codes of (row top-1 log-prob - log-prob) in steps of 1/8, 1/16, 1/32 nat (max error half
a step; codes past 255 clipped, their share reported), the row's top-1 log-prob and tail as float16.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.topk import ZSTD_LEVEL, read_manifest  # noqa: E402


def parquet_bytes(table: pa.Table) -> int:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", compression_level=ZSTD_LEVEL)
    return len(buf.getvalue())


def lists(values: np.ndarray, k: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("teacher_dir", help="a top-k teacher folder (its topk_manifest.parquet)")
    args = ap.parse_args()
    out = Path(args.teacher_dir)
    manifest = read_manifest(out)
    if manifest is None or manifest.store_of("train") != "topk":
        raise SystemExit(f"{out}: not a top-k teacher folder")
    k = manifest.k
    train = [s for s in manifest.shards if s.split == "train"]
    t = pa.concat_tables([pq.read_table(out / s.file) for s in train])
    n = len(t)
    ids = t.column("ids").combine_chunks().flatten().to_numpy().reshape(n, k).astype(np.int64)
    lp = t.column("logprobs").combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(n, k)
    lp = lp.astype(np.float32)
    order = np.argsort(ids, axis=1, kind="stable")
    sorted_ids, sorted_lp = np.take_along_axis(ids, order, 1), np.take_along_axis(lp, order, 1)
    gaps = np.diff(sorted_ids, axis=1, prepend=0).astype(np.uint16)
    keys = {"seq_id": t.column("seq_id"), "pos": t.column("pos")}
    row = {
        "top": pa.array(lp.max(axis=1).astype(np.float16)),
        "tail": pa.array(t.column("tail").to_numpy().astype(np.float16)),
    }
    rows = {"v1": round(sum((out / s.file).stat().st_size for s in train) / n, 1)}
    for step in (1 / 8, 1 / 16, 1 / 32):
        d = (lp.max(axis=1, keepdims=True) - sorted_lp) / step
        codes = np.clip(np.round(d), 0, 255).astype(np.uint8)
        name = f"step_1/{round(1 / step)}"
        flat = pa.table({**keys, "gaps": lists(gaps, k), "codes": lists(codes, k), **row})
        split = pa.table(
            {**keys, "hi": lists((gaps >> 8).astype(np.uint8), k), "lo": lists((gaps & 255).astype(np.uint8), k),
             "codes": lists(codes, k), **row}
        )  # fmt: skip
        rows[name] = {
            "gaps_u16": round(parquet_bytes(flat) / n, 1),
            "gaps_hi_lo": round(parquet_bytes(split) / n, 1),
            "max_error_nat": step / 2,
            "clipped_share": float((d > 255.5).mean()),
        }
    emit = {"positions": n, "k": k, "bytes_per_position": rows}
    emit["gap_percentiles_50_90_99"] = np.percentile(gaps[:, 1:], [50, 90, 99]).tolist()
    print(json.dumps(emit))


if __name__ == "__main__":
    main()
