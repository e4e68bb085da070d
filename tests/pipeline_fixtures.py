"""Tiny end-to-end inputs for pipeline tests: a llama GGUF with a small GPT-2 BPE tokenizer, text data, a
config, one Prefect test server per test process (prefect_test_harness starts in ~12 s; it is shared by every
module that asks for it and stopped at the end of the session), and one reference flow run on it.

    from tests.pipeline_fixtures import _prefect_harness, _reference_run, tiny_config  # noqa: F401 (fixtures)
"""

from __future__ import annotations

import atexit
import json
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from model import reference as R
from model.config import ModelConfig
from model.gguf import llama_metadata, write_gguf

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Merges of the tiny tokenizer (GPT-2 byte-level alphabet: 'Ġ' is a space); each adds the merged token.
MERGES = (
    "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a n", "Ġ w", "e n", "Ġ o", "n d",
    "Ġa nd", "o u", "Ġ b", "Ġ f", "i t", "Ġ l", "Ġ m", "e d", "a r", "Ġ h", "o r", "i s", "Ġ c", "in g",
)  # fmt: skip
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = (
    "the river runs over stone and sand while birds sing in the morning light a farmer walks to his field "
    "with bread and water the wind turns the old mill and the children laugh by the shore of the lake"
).split()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def tokenizer_metadata(extra_tokens: tuple[str, ...] = ()) -> dict[str, Any]:
    """tokenizer.ggml.* keys of a byte-level BPE: 256 byte tokens, MERGES, extras, ChatML specials."""
    tokens = list(_bytes_to_unicode().values())
    tokens += [m.replace(" ", "") for m in MERGES] + list(extra_tokens)
    n_normal = len(tokens)
    tokens += list(SPECIALS)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([1] * n_normal + [3] * len(SPECIALS), np.int32),
        "tokenizer.ggml.merges": list(MERGES),
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.bos_token_id": tokens.index("<|im_start|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


def write_tiny_llama(path: Path, seed: int = 1, context_length: int = 64, extra_tokens: tuple[str, ...] = ()) -> Path:
    """An F32 llama GGUF (2 blocks, hidden 32) whose vocabulary is the tiny tokenizer's."""
    meta = tokenizer_metadata(extra_tokens)
    vocab = len(meta["tokenizer.ggml.tokens"])
    cfg = ModelConfig(
        n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=vocab, context_length=context_length
    )
    weights = R.random_weights(cfg, seed=seed, dtype=np.float32)
    meta.update(llama_metadata(cfg, name="tiny-llama"))
    write_gguf(path, "llama", meta, ((n, w, Q.F32) for n, w in weights.items()))
    return path


def write_texts(path: Path, n_docs: int = 36, seed: int = 0) -> Path:
    """n_docs short pseudo-English documents as jsonl {"text": ...}."""
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(n_docs):
            words = rng.choice(WORDS, size=int(rng.integers(8, 20)))
            fh.write(json.dumps({"text": " ".join(words).capitalize() + "."}) + "\n")
    return path


@cache
def _inputs_dir() -> Path:
    root = Path(tempfile.mkdtemp(prefix="distillery-inputs-"))
    write_tiny_llama(root / "teacher-f32.gguf")
    write_texts(root / "texts.jsonl")
    return root


def tiny_inputs() -> Path:
    """A folder (made once per process) with teacher-f32.gguf and texts.jsonl."""
    return _inputs_dir()


def tiny_config(workdir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """The tiny run config as a dict (load with RunConfig.model_validate); `sections` update its sections."""
    inputs = tiny_inputs()
    cfg: dict[str, Any] = {
        "model": {
            "student": str(inputs / "teacher-f32.gguf"),
            "teacher": str(inputs / "teacher-f32.gguf"),
            "student_quant": ["Q4_0"],
        },
        "data": {"path": str(inputs / "texts.jsonl"), "seq_len": 24, "eval_fraction": 0.2},
        "teacher": {"top_k": 8, "shard_tokens": 96, "backend": "numpy"},
        "lora": {"r": 4, "alpha": 8.0, "targets": ["q", "v", "down"]},
        "optim": {"lr": 5e-3, "warmup_steps": 2},
        "train": {"epochs": 2, "batch_size": 4, "checkpoint_every": 2, "precision": "f32"},
        "export": {"merge": True},
        "run": {"workdir": str(workdir), "experiment": "tiny", "gpu_backend": "wgpu"},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


# ---------------------------------------------------------------------------------------------- Prefect


def run_summary(**fields: Any) -> dict[str, Any]:
    """A flow's summary as flows.cli.print_report reads it: no stage run, a local MLflow run, no Prefect page;
    `fields` add to it or replace."""
    return {
        "stages": {"ran": [], "cached": []},
        "mlflow": {"run_id": "r", "tracking_uri": "sqlite:///x.db", "url": "http://127.0.0.1:5000/#/r"},
        "seconds": 1.0,
        "flow_run_name": "n",
        "flow_run_id": "abc",
        "prefect_url": None,
        **fields,
    }


_harness: list[ExitStack] = []


def prefect_server() -> None:
    """Start prefect_test_harness once per process, with PREFECT_HOME and local storage in a tmp dir."""
    if _harness:
        return
    import prefect.settings as ps
    from prefect.testing.utilities import prefect_test_harness

    home = Path(tempfile.mkdtemp(prefix="distillery-prefect-"))
    stack = ExitStack()
    stack.enter_context(
        ps.temporary_settings(
            updates={
                ps.PREFECT_HOME: str(home),
                ps.PREFECT_LOCAL_STORAGE_PATH: str(home / "storage"),
                ps.PREFECT_SERVER_ANALYTICS_ENABLED: False,
            }
        )
    )
    stack.enter_context(prefect_test_harness(server_startup_timeout=60))
    _harness.append(stack)
    atexit.register(stop_prefect_server)


def stop_prefect_server() -> None:
    """Stop the test server (at the end of the session, while pytest's streams are still open)."""
    while _harness:
        _harness.pop().close()


@pytest.fixture(scope="session", name="prefect_harness")
def _prefect_harness() -> Iterator[None]:
    """Session fixture: the shared Prefect test server; import it into a test module to use it."""
    prefect_server()
    yield
    stop_prefect_server()


_reference: list[tuple[dict[str, Any], dict[str, Any]]] = []


@pytest.fixture(scope="session", name="reference_run")
def _reference_run(prefect_harness: None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config dict, run summary) of one uninterrupted flow run of the tiny config with short epochs, made once
    per process and shared by the modules that import this fixture (a rerun of the same config is fully
    cached). What the stages compute is tested without Prefect in tests/test_stages.py, on full epochs."""
    if not _reference:
        from flows.distill import run_pipeline
        from schemas.config import RunConfig
        from tests.gpu_fixtures import device_or_skip

        device_or_skip()
        workdir = Path(tempfile.mkdtemp(prefix="distillery-reference-")) / "run"
        cfg = tiny_config(workdir, train={"max_steps_per_epoch": 4})
        _reference.append((cfg, run_pipeline(RunConfig.model_validate(cfg))))
    return _reference[0]
