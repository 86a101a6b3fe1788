"""`specee-cpp` command line: thin typer adapters over the API; all rich rendering lives here.

User mistakes (SpeceeError) print one line on stderr and exit 1, never a traceback.
"""
from __future__ import annotations

import sys

import typer

from ..errors import SpeceeError
from . import run, manage, lab  # noqa: F401, I001  (registers the commands: everyday first)
from .common import app, err


def _interrupted() -> None:
    cmd = next((a for a in sys.argv[1:] if not a.startswith("-")), "command")
    # every command writes its files whole (temporary name, then rename), so nothing half
    # written is left under a final name
    err.print(f"\ninterrupted: specee-cpp {cmd} stopped by Ctrl-C (exit 130); files it had "
              f"finished are kept, nothing half-written is")


def main() -> None:
    """Entry point: run the app, turning user errors into one line and exit status 1."""
    try:
        # typer turns Ctrl-C into a *returned* 130 outside standalone mode: pass it on, or a
        # script would take an interrupted run for a success
        rc = app(standalone_mode=False)
        if isinstance(rc, int) and rc != 0:
            if rc == 130:
                _interrupted()
            sys.exit(rc)
    except SpeceeError as e:
        err.print(f"[red]error:[/red] {e}", markup=True, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        _interrupted()
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as e:  # usage errors in standalone_mode=False
        # click's ClickException, vendored by newer typer releases (no click import then)
        if callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()

