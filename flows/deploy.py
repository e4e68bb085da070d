"""`python -m flows.deploy CONFIG --cron ... --name ...`: the old entry point of `distillery serve` (flows/serve.py)."""

from __future__ import annotations

import typer

from flows.cli import serve

if __name__ == "__main__":
    typer.run(serve)
