"""The `distillery` command line (typer). Errors from the library are caught once here and shown plainly."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="Distil a full-precision teacher into a quantized GGUF student with LoRA trained on the GPU (wgpu).",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)


def _fail(exc: Exception) -> None:
    err_console.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(code=1)


@app.command()
def inspect(
    path: Annotated[Path, typer.Argument(help="A GGUF file (model or LoRA adapter).")],
) -> None:
    """Print a GGUF file's architecture, hyper-parameters, tensors by type, sizes and tokenizer."""
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


@app.command()
def demo(
    verses: Annotated[int, typer.Option(help="How many KJV verses (from Genesis 1) to evaluate on.")] = 24,
    workdir: Annotated[Path, typer.Option(help="Where the demo writes its student/teacher GGUFs.")] = Path(
        "runs/demo"
    ),
) -> None:
    """Inspect the demo model, build a 4-bit student and measure its gap to the teacher (numpy reference)."""
    from flows.demo import run_demo

    try:
        run_demo(workdir=workdir, n_verses=verses, console=console)
    except (ValueError, OSError) as exc:
        _fail(exc)


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


if __name__ == "__main__":
    app()
