"""Models and this machine: pull, models, doctor."""
from __future__ import annotations

from typing import Optional

import typer
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from ..errors import SpeceeError
from ..models.registry import load_registry

from .common import app, err, out

# ---- models ---------------------------------------------------------------------------------

def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=err)


@app.command()
def pull(
    names: Optional[list[str]] = typer.Argument(None, help="Registry names to fetch."),
    pair: Optional[str] = typer.Option(None, "--pair", help="Also fetch this pair's models."),
    force: bool = typer.Option(False, "--force", help="Fetch again even if present."),
    quick: bool = typer.Option(False, "--quick",
                               help="Trust a present file's verification stamp (size, mtime) "
                                    "instead of hashing it again."),
) -> None:
    """Download registry models into the cache, verify their sha256, keep them. A present
    file is hashed again (its bytes may have changed with size and mtime restored)."""
    from ..models.pull import is_verified
    from ..models.pull import pull as pull_model

    reg = load_registry()
    entries = [reg.get(n) for n in names or []]
    if pair:
        entries += [e for e in reg.pair(pair) if e not in entries]
    if not entries:
        raise SpeceeError(f"name a model or --pair; registry names: "
                          f"{', '.join(sorted(reg.models))}")
    for entry in entries:
        if quick and is_verified(entry):  # nothing to fetch or hash: no progress bar
            err.print(f"[green]ok[/green] {entry.name}: {entry.local_path}", soft_wrap=True)
            continue
        with _progress() as bar:
            task = bar.add_task(entry.name, total=entry.size)

            def progress(desc: str, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total,
                           description=f"{entry.name} [dim]{desc}[/dim]")

            path = pull_model(entry, progress=progress, force=force, rehash=not quick)
        err.print(f"[green]ok[/green] {entry.name}: {path}", soft_wrap=True)


@app.command()
def models() -> None:
    """List the registry and what is present locally."""
    from ..models.pull import is_verified, unfinished_work, verified_at

    reg = load_registry()
    table = Table(title="specee-cpp models")
    for col in ("name", "role", "arch", "quant", "size", "local"):
        table.add_column(col)
    for e in reg.models.values():
        if is_verified(e):
            local = f"[green]verified {verified_at(e.local_path) or ''}[/green] {e.local_path}"
        elif e.local_path.is_file():
            local = "[yellow]present, not verified[/yellow]"
        else:
            local = "[dim]-[/dim]"
        table.add_row(e.name, e.role, e.arch, e.quant, f"{e.size / 2**20:.0f} MiB", local)
    out.print(table)
    for name, (t, d) in reg.pairs.items():
        out.print(f"pair [bold]{name}[/bold]: target {t}, draft {d}")
    folders = {e.local_path.parent for e in reg.models.values()}
    n, size = unfinished_work(*folders)
    if n:
        out.print(f"[yellow]{n} unfinished download folder{'s' if n > 1 else ''} (.pull-*, "
                  f"{size / 2**20:.0f} MiB)[/yellow] in {', '.join(map(str, folders))}: the "
                  f"next pull removes those whose pull has ended")


@app.command()
def doctor() -> None:
    """Check the library build, the patch, CPU/GPU features and the cache."""
    from ..doctor import diagnose

    rows, ok = diagnose()
    table = Table(title="specee-cpp doctor", show_header=False)
    table.add_column("check")
    table.add_column("result", overflow="fold")
    for k, v in rows:
        table.add_row(k, str(v))
    out.print(table)
    if not ok:
        raise typer.Exit(1)


