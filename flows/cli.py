"""The `distillery` command line (typer). Errors from the library are caught once here and shown plainly."""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

app = typer.Typer(
    help="Distil a full-precision teacher into a quantized GGUF student with LoRA trained on the GPU "
    "(wgpu).\n\nStart with `distillery demo`, or write a config (see configs/example.yaml) and "
    "`distillery run CONFIG`.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(soft_wrap=True)  # long paths and URLs stay on one line (copyable)
err_console = Console(stderr=True, soft_wrap=True)  # an error stays one line in a log, whatever its width

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


def _user_error(exc: BaseException | None) -> bool:
    """Errors a user can act on (bad input, an unusable file): shown as their one-line message."""
    return isinstance(exc, ValueError | OSError)


def _one_line(text: str) -> str:
    """A multi-line message (a config with several bad fields) as one line: 'head: item; item'."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) < 2:
        return " ".join(text.split())
    head, items = lines[0], "; ".join(lines[1:])
    return f"{head} {items}" if head.endswith(":") else f"{head}; {items}"


def _fail(exc: BaseException) -> None:
    message = _one_line(str(exc))
    kind = "" if _user_error(exc) else f"{type(exc).__name__}: "
    err_console.print(Text.assemble(("error:", "bold red"), f" {kind}{message}"), highlight=False)
    raise typer.Exit(code=1)


class _OneLineUserErrors(logging.Formatter):
    """Prefect's console formatter, minus the traceback of a user error (the API's log keeps it)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info and _user_error(record.exc_info[1])):
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def _quiet_prefect_console() -> None:
    """A failed stage's user error shows on the console as its one line, not a traceback (bugs keep theirs)."""
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler" and handler.formatter is not None:
            if not isinstance(handler.formatter, _OneLineUserErrors):
                handler.setFormatter(_OneLineUserErrors(handler.formatter))


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


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C is, so a run unwinds the same way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP interrupt the run like Ctrl-C (exit 128 + signal number)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _prefect_env(workdir: Path) -> bool:
    """Keep Prefect's state under the workdir unless the user pointed it elsewhere (only effective before
    prefect is imported): PREFECT_HOME (the temporary server's database), local result storage, no
    analytics. True when the run needs a temporary server (no PREFECT_API_URL, prefect not imported yet)."""
    if "prefect" in sys.modules:
        return False
    home = workdir.resolve() / ".prefect"
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(home / "storage"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return not os.environ.get("PREFECT_API_URL")


@contextlib.contextmanager
def _prefect_api(workdir: Path, flow_module: str) -> Iterator[bool]:
    """PREFECT_API_URL for the flow: the user's server, or this workdir's temporary one (flows/server.py),
    started or reused here and left when the block ends; `flow_module` (and with it Prefect and MLflow) is
    imported while a new server starts. Yields whether it is the temporary one."""
    if not _prefect_env(workdir):
        yield False
        return
    from flows.server import MARK_ENV, TemporaryServer

    def meanwhile(api_url: str) -> None:
        os.environ.update({"PREFECT_API_URL": api_url, MARK_ENV: "temporary"})  # before prefect is imported
        importlib.import_module(flow_module)

    try:
        with TemporaryServer(os.environ["PREFECT_HOME"], meanwhile=meanwhile):
            try:
                yield True
            finally:
                _drain_prefect()
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        os.environ.pop(MARK_ENV, None)


def _drain_prefect() -> None:
    """Send the run's queued logs and events while its server is up (else Prefect retries them at exit)."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=5)


def _load_config(config: Path | None, overrides: list[str]) -> Any:
    """load_config, its errors naming the config file too (an override's error names only the override)."""
    from schemas.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as exc:
        if config is None or str(config) in str(exc):
            raise
        raise ConfigError(f"{config}: {exc}") from None


def _writable_workdir(path: str | Path) -> Path:
    """The run's workdir, created; an InputError naming run.workdir when it cannot be written."""
    from stages.inputs import InputError

    root = Path(path).expanduser().resolve()
    probe = root / f".write-test-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InputError(f"run.workdir: {root}: not writable ({exc.strerror or exc})") from None
    return root


def _waiting(root: Path, holder: str) -> None:
    err_console.print(f"waiting: another run ({holder}) is using {root}; this one continues when it ends")


def _results(cfg: Any, root: Path, until: str) -> dict[str, Any]:
    """A fully cached run answered from its verified results without Prefect; else the flow, one run per
    workdir at a time (a second one waits, then usually finds everything cached)."""
    from flows.locks import workdir_lock
    from tasks.cached import cached_run

    if cfg.run.task == "dpo":
        return _preference_results(cfg, root, until)
    if (summary := cached_run(cfg, until)) is not None:
        return summary
    with workdir_lock(root, waiting=lambda holder: _waiting(root, holder)):
        if (summary := cached_run(cfg, until)) is not None:  # the run we waited for made everything
            return summary
        with _prefect_api(root, "flows.distill"):
            from flows.distill import run_pipeline

            _quiet_prefect_console()
            return run_pipeline(cfg, until)  # type: ignore[arg-type]


def _preference_results(cfg: Any, root: Path, until: str) -> dict[str, Any]:
    """A preference run (run.task: dpo): flows/preference.py under the workdir lock (its stages cached by content)."""
    from flows.locks import workdir_lock

    with workdir_lock(root, waiting=lambda holder: _waiting(root, holder)), _prefect_api(root, "flows.preference"):
        from flows.preference import run_preference

        _quiet_prefect_console()
        return run_preference(cfg, until)  # type: ignore[arg-type]


def _run(config: Path | None, overrides: list[str] | None, until: str, extra: tuple[str, ...] = ()) -> None:
    """Load the config, check inputs (before any Prefect server starts), answer a fully cached run from its
    verified results without Prefect, else run the flow; print the report."""
    try:
        with _signals_interrupt():
            from stages.inputs import check_inputs

            cfg = _load_config(config, [*(overrides or []), *extra])
            if cfg.run.task == "dpo":
                from stages.pairs import check_inputs  # the preference preflight (the chat template, the reference)
            check_inputs(cfg)
            root = _writable_workdir(cfg.run.workdir)  # created only for inputs that passed the preflight
            summary = _results(cfg, root, until)
    except KeyboardInterrupt as exc:
        code = 128 + exc.signum if isinstance(exc, Terminated) else 130
        why = f" by {exc}" if isinstance(exc, Terminated) else ""
        err_console.print(f"[bold red]interrupted[/]{why}: rerun the same command to resume from the cache")
        raise typer.Exit(code=code) from None
    except typer.Exit:
        raise
    except Exception as exc:  # noqa: BLE001 -- the one place errors become a message and exit status 1
        _fail(exc)
    finally:
        gc.freeze()  # the interpreter's last collection then skips Prefect's and MLflow's modules (seconds)
    print_report(summary, root)


def print_report(summary: dict[str, Any], workdir: Path) -> None:
    """Before/after table, stages ran/cached, files, and where the MLflow / Prefect records are (a cached rerun
    names the run whose results it reused)."""
    if summary.get("task") == "dpo":
        from flows.preference import print_table

        print_table(summary, console)
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
            ece = ""
            if base.get("ece") is not None and best.get("ece") is not None:
                ece = f", calibration (ECE of the student's top-1) {base['ece']:.4f} → {best['ece']:.4f}"
            console.print(
                f"KL {base['kl']:.4f} → {best['kl']:.4f} ({abs(pct):.1f}% {direction}), "
                f"top-1 {100 * base['top1']:.1f}% → {100 * best['top1']:.1f}%{ece}"
            )
        from stages.evaluate import gain_kept, gain_note

        merged = summary.get("merged")
        kept = None if merged is None or best is None else gain_kept(base["kl"], best["kl"], merged["kl"])
        note = gain_note(kept, summary.get("lora_kind", "plain"))
        if note:
            console.print(f"[bold yellow]{note}[/]" if "Warning" in note else note)
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
    reused = summary.get("reused", False)
    console.print(f"report: {summary.get('report')}  ({summary['seconds']:.1f} s)")
    if reused:
        console.print("every stage reused after verifying its files: the records below are the run that made them")
    console.print(
        f"MLflow run {ml['run_id']} in {ml['tracking_uri']}" + (" (reused: nothing logged)" if reused else "")
    )
    if ml["tracking_uri"].startswith("sqlite:"):
        console.print(f"  UI: infra/mlflow-server.sh {workdir}  then open {ml['url']}")
    else:
        console.print(f"  UI: {ml['url']}")
    console.print(f"Prefect flow run {summary['flow_run_name']} ({summary['flow_run_id']})")
    url = summary.get("prefect_url")
    if url and not str(url).startswith("None"):
        console.print(f"  UI: {url}")
    else:  # the temporary server is gone: its database stays under the workdir
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
    """Merge the best adapter into the student (W + alpha/r * B A) as a new GGUF; evaluate it.

    Same as `run --set export.merge=true`; the merged file is evaluated like the adapter it came from and the
    share of the adapter's held-out KL gain it keeps is printed (a warning below 50 %). A mergeable adapter
    (lora.kind mergeable) folds exactly into the 4-bit blocks; a plain one is requantized (docs/merge.md).
    """
    extra = ("export.merge=true",) + ((f"export.merge_quant={quant}",) if quant else ())
    _run(config, set_, "export", extra)


@app.command()
def demo(
    verses: Annotated[
        int,
        typer.Option(
            help="Train on at most this many KJV verses of the training text (from Genesis 1:1 on; 0: no cap). "
            "The held-out book of Ruth is never cut."
        ),
    ] = 0,
    config: Annotated[Path, typer.Option(help="The demo's run config.")] = Path("configs/demo.yaml"),
    set_: SetOpt = None,
) -> None:
    """SmolLM2-135M: F32 teacher vs a requantized Q4_K/Q4_0 student, distilled on KJV text (runs/demo).

    Prepares runs/demo/teacher-f32.gguf (the shipped Q4_1 model dequantized), the training text (chapter 1 of
    Genesis, Exodus, Joshua, Judges, 1 and 2 Samuel, 1 Kings and Matthew: runs/demo/kjv-train.jsonl) and the
    held-out text (the book of Ruth, never trained on: runs/demo/kjv-ruth.jsonl), then runs the pipeline with
    configs/demo.yaml and prints the held-out KL, top-1 and CE before and after, and of the merged GGUF.
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
def deploy(
    config: ConfigArg = None,
    set_: SetOpt = None,
    pool: Annotated[str, typer.Option(help="Process work pool whose workers run it (infra/up.sh team mode).")] = (
        "distillery"
    ),
    name: Annotated[str, typer.Option(help="Deployment name: runs show as distill/NAME.")] = "team",
    cron: Annotated[
        str | None, typer.Option(help="Cron schedule, e.g. '0 3 * * *' (03:00 daily); omitted: on demand only.")
    ] = None,
    until: Annotated[str, typer.Option(help="Last stage: tokenize, teacher, train, evaluate or export.")] = "export",
) -> None:
    """Register the flow with CONFIG as deployment distill/NAME on a work pool (needs PREFECT_API_URL).

    Any worker of the pool runs it (`infra/up.sh` in team mode starts a PostgreSQL-backed server and workers;
    `infra/worker.sh` adds one on another machine). Workers must see this checkout and the config's workdir at
    the same paths. Start runs from the schedule, `prefect deployment run distill/NAME` or the Prefect UI.
    """
    from flows.serve import deploy as deploy_to_pool

    try:
        deployment_id = deploy_to_pool(config, set_ or [], pool=pool, name=name, cron=cron, until=until)
    except Exception as exc:  # noqa: BLE001
        _fail(exc)
    console.print(f"deployment distill/{name} ({deployment_id}) on work pool {pool!r}")


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
