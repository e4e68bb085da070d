"""The `distillery` command line (typer). Errors from the library are caught once here and shown plainly."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="Distil a full-precision teacher into a quantized GGUF student with LoRA trained on the GPU "
    "(wgpu).\n\nStart with `distillery demo`, or write a config (see configs/example.yaml) and "
    "`distillery run CONFIG`.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(soft_wrap=True)  # long paths and URLs stay on one line (copyable)
err_console = Console(stderr=True)

ConfigArg = Annotated[
    Path | None,
    typer.Argument(
        help="Run config (YAML/JSON; see configs/example.yaml). Omitted: defaults, so --set model.* and data.path."
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a config field, e.g. --set lora.r=8 --set optim.lr=1e-4 (YAML values; repeatable).",
    ),
]


def _fail(exc: BaseException) -> None:
    message = " ".join(str(exc).split()) if not isinstance(exc, ValueError) else str(exc).strip()
    kind = "" if isinstance(exc, ValueError | OSError) else f"{type(exc).__name__}: "
    err_console.print(f"[bold red]error:[/] {kind}{message}", highlight=False)
    raise typer.Exit(code=1)


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A GGUF file (model or LoRA adapter).")],
) -> None:
    """Print a GGUF file's architecture, model family and its settings, tensors by type, sizes and tokenizer."""
    from model.gguf import GGUFError, describe

    try:
        info = describe(path)
    except (GGUFError, OSError) as exc:
        _fail(exc)
    table = Table(title=str(path), show_header=False)
    for key, value in info.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        table.add_row(key, str(value))
    console.print(table)


# ---------------------------------------------------------------------------------------------- pipeline


def _prefect_env(workdir: Path) -> None:
    """Keep Prefect's state under the workdir unless the user pointed it elsewhere (only effective before
    prefect is imported): PREFECT_HOME (the ephemeral server's database), local result storage, no
    analytics."""
    if "prefect" in sys.modules:
        return
    home = workdir.resolve() / ".prefect"
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(home / "storage"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _run(config: Path | None, overrides: list[str] | None, until: str, extra: tuple[str, ...] = ()) -> None:
    """Load the config, check inputs (before any Prefect server starts), run the flow, print the report."""
    from schemas.config import load_config
    from stages.inputs import check_inputs

    try:
        cfg = load_config(config, [*(overrides or []), *extra])
        _prefect_env(Path(cfg.run.workdir))
        check_inputs(cfg)
        from flows.distill import run_pipeline

        summary = run_pipeline(cfg, until)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]: rerun the same command to resume from the cache")
        raise typer.Exit(code=130) from None
    except typer.Exit:
        raise
    except Exception as exc:  # noqa: BLE001 -- the one place errors become a message and exit status 1
        _fail(exc)
    print_report(summary, Path(cfg.run.workdir))


def print_report(summary: dict[str, Any], workdir: Path) -> None:
    """Before/after table, stages ran/cached, files, and where the MLflow / Prefect records are."""
    if summary.get("baseline") is not None:
        table = Table(title="held-out: teacher vs student")
        for col in ("student", "KL(teacher‖student)", "top-1", "CE", "ppl"):
            table.add_column(col, justify="left" if col == "student" else "right")
        rows = [("before (no adapter)", summary["baseline"])]
        rows += [
            (f"epoch {e['epoch']}" + (" (best)" if e["epoch"] == summary["best_epoch"] else ""), e)
            for e in summary["evals"]
        ]
        if summary.get("merged"):
            rows.append(("merged GGUF", summary["merged"]))
        for label, e in rows:
            table.add_row(label, f"{e['kl']:.4f}", f"{100 * e['top1']:.1f}%", f"{e['ce']:.4f}", f"{e['ppl']:.2f}")
        console.print(table)
        base, best = summary["baseline"], summary["best"]
        if best is not None and base["kl"]:
            pct = 100 * (base["kl"] - best["kl"]) / base["kl"]
            direction = "lower" if pct >= 0 else "higher"
            console.print(
                f"KL {base['kl']:.4f} → {best['kl']:.4f} ({abs(pct):.1f}% {direction}), "
                f"top-1 {100 * base['top1']:.1f}% → {100 * best['top1']:.1f}%"
            )
    stages = summary["stages"]
    console.print(f"ran: {', '.join(stages['ran']) or 'nothing (all cached)'}")
    console.print(f"cached: {', '.join(stages['cached']) or 'nothing'}")
    files = summary.get("files") or {}
    for key, label in (("peft_dir", "PEFT adapter"), ("gguf_lora", "GGUF LoRA"), ("merged", "merged GGUF")):
        if key in files:
            console.print(f"{label}: {workdir / files[key]}")
    if summary.get("registered_model"):
        reg = summary["registered_model"]
        note = "" if reg.get("new", True) else " (this adapter was registered before)"
        console.print(f"registered model: {reg['name']} version {reg['version']}{note}")
    ml = summary["mlflow"]
    console.print(f"report: {summary.get('report')}  ({summary['seconds']:.1f} s)")
    console.print(f"MLflow run {ml['run_id']} in {ml['tracking_uri']}")
    if ml["tracking_uri"].startswith("sqlite:"):
        console.print(f"  UI: infra/mlflow-server.sh {workdir}  then open {ml['url']}")
    else:
        console.print(f"  UI: {ml['url']}")
    console.print(f"Prefect flow run {summary['flow_run_name']} ({summary['flow_run_id']})")
    if os.environ.get("PREFECT_API_URL"):
        console.print(f"  UI: {summary.get('prefect_url')}")
    else:
        home = os.environ.get("PREFECT_HOME", str(workdir / ".prefect"))
        console.print(
            f"  UI: PREFECT_HOME={home} infra/prefect-server.sh  then open "
            f"http://127.0.0.1:4200/runs/flow-run/{summary['flow_run_id']}"
        )


@app.command()
def run(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Run the whole pipeline: tokenize, student, teacher top-k, train, evaluate, select, export.

    Every stage is cached by the content of its inputs: rerunning resumes where a crashed run stopped, and an
    identical rerun does no work. Changing a field recomputes only the stages that read it. Prints the
    before/after table and where the MLflow and Prefect records are.
    """
    _run(config, set_, "export")


@app.command()
def tokenize(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Tokenize data.path with the student's tokenizer into train/eval token shards (and prepare the student).

    Reads jsonl/json/parquet/text files or a saved HF dataset dir; chat records ({messages: [...]}) use the
    GGUF's chat template with loss on assistant tokens only.
    """
    _run(config, set_, "tokenize")


@app.command()
def teacher(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Precompute the teacher's top-k next-token distributions (Parquet shards, one task per shard).

    Runs tokenize first (cached). Refuses a teacher/student vocabulary mismatch before any work; a crashed run
    resumes, skipping every shard that verifies.
    """
    _run(config, set_, "teacher")


@app.command()
def train(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Train the LoRA adapter for train.epochs epochs (after tokenize and teacher, cached).

    Checkpoints every train.checkpoint_every steps and at each epoch end; a killed run resumes from its last
    checkpoint and ends with the same adapter bytes.
    """
    _run(config, set_, "train")


@app.command()
def evaluate(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Evaluate the student without an adapter and after each epoch on the held-out split; pick the best.

    Metrics: KL(teacher || student) over the top-k + tail, top-1 agreement, CE / perplexity. The best epoch is
    chosen by eval.best_metric.
    """
    _run(config, set_, "evaluate")


@app.command()
def export(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Export the best checkpoint: PEFT dir (HF peft) and GGUF LoRA (llama.cpp --lora), per export.*.

    Runs every earlier stage as needed (cached); same as `run`.
    """
    _run(config, set_, "export")


@app.command()
def merge(
    config: ConfigArg = None,
    set_: SetOpt = None,
    quant: Annotated[
        str | None,
        typer.Option(help="Types for the merged weights, e.g. Q4_K,Q4_0 (default: keep each tensor's type)."),
    ] = None,
) -> None:
    """Merge the best adapter into the student (W + alpha/r * B A, requantized) as a new GGUF; evaluate it.

    Same as `run --set export.merge=true`; the merged file is evaluated like the adapter it came from.
    """
    extra = ("export.merge=true",) + ((f"export.merge_quant={quant}",) if quant else ())
    _run(config, set_, "export", extra)


@app.command()
def demo(
    verses: Annotated[int, typer.Option(help="How many KJV verses (from Genesis 1) to train and evaluate on.")] = 0,
    config: Annotated[Path, typer.Option(help="The demo's run config.")] = Path("configs/demo.yaml"),
    set_: SetOpt = None,
) -> None:
    """SmolLM2-135M: F32 teacher vs a requantized Q4_K/Q4_0 student, distilled on KJV verses (runs/demo).

    Prepares runs/demo/teacher-f32.gguf (the shipped Q4_1 model dequantized) and runs/demo/kjv.jsonl, then
    runs the pipeline with configs/demo.yaml and prints how far the KL fell.
    """
    from flows.demo import prepare_demo
    from schemas.config import load_config

    try:
        cfg = load_config(config, list(set_ or []))
        _prefect_env(Path(cfg.run.workdir))
        prepare_demo(cfg, n_verses=verses or None, console=console)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    _run(config, set_, "export")


@app.command()
def doctor(
    seconds: Annotated[float, typer.Option(help="How long the GEMM probe runs.")] = 1.0,
    backend: Annotated[str, typer.Option(help="auto, wgpu (wgpu-native) or dawn (tensor cores).")] = "auto",
) -> None:
    """Show the GPU backend, adapter, limits and features, and measure an f32 GEMM for about a second."""
    from gpu.device import DeviceError
    from gpu.probe import gemm_probe

    try:
        info = gemm_probe(backend=backend, seconds=seconds)
    except DeviceError as exc:
        _fail(exc)
    table = Table(title="distillery doctor", show_header=False)
    for key, value in info.items():
        if isinstance(value, dict):
            value = "\n".join(f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ", ".join(map(str, value))
        table.add_row(key, str(value))
    console.print(table)


# ---------------------------------------------------------------------------------------------- operations


@app.command()
def serve(
    config: ConfigArg = None,
    set_: SetOpt = None,
    cron: Annotated[
        str | None, typer.Option(help="Cron schedule, e.g. '0 3 * * *' (03:00 daily); omitted: on demand only.")
    ] = None,
    name: Annotated[str, typer.Option(help="Deployment name: runs show as distill/NAME.")] = "scheduled",
    until: Annotated[str, typer.Option(help="Last stage: tokenize, teacher, train, evaluate or export.")] = "export",
) -> None:
    """Serve the flow as Prefect deployment distill/NAME (needs PREFECT_API_URL; see infra/up.sh).

    Runs start at each cron tick, from `prefect deployment run distill/NAME`, or from the Prefect UI's run form
    (every config field with its description); they cache stages under the config's workdir. Ctrl-C stops.
    """
    from flows.serve import serve as serve_deployment

    try:
        serve_deployment(config, set_ or [], cron=cron, name=name, until=until)
    except KeyboardInterrupt:
        raise typer.Exit(code=130) from None
    except Exception as exc:  # noqa: BLE001
        _fail(exc)


@app.command()
def compare(
    runs: Annotated[
        list[str] | None, typer.Argument(help="MLflow run ids (or prefixes) or run names; default: all.")
    ] = None,
    experiment: Annotated[
        str | None, typer.Option(help="MLflow experiment (default: the config's, or distillery).")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="A run config: its run.workdir / mlflow_uri / experiment.")
    ] = None,
    workdir: Annotated[
        Path | None, typer.Option(help="A workdir whose sqlite store to read (default runs/default).")
    ] = None,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI, e.g. http://127.0.0.1:5000.")] = None,
) -> None:
    """Compare runs from MLflow: the config fields that differ, best KL, top-1, tokens/s, gap closed.

    Gap closed = (baseline KL - best KL) / baseline KL. For a tracking server it also prints the MLflow UI's
    compare view of the same runs.
    """
    from flows.compare import compare_runs

    try:
        compare_runs(console, list(runs or []), experiment=experiment, config=config, workdir=workdir, uri=tracking_uri)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)


if __name__ == "__main__":
    app()
