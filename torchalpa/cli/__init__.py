"""torchalpa's command line (``torchalpa ...`` or ``python -m torchalpa ...``)."""

from torchalpa.cli.commands import main

__all__ = ["main"]
