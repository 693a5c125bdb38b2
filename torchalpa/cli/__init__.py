"""torchalpa's command line (``torchalpa ...`` or ``python -m torchalpa ...``).

- ``commands``: the commands and their arguments.
- ``stablehlo_commands``: the StableHLO side of the commands (``plan --stablehlo``, export).
- ``workloads``: what the arguments name, a model (zoo, suite, module or file) and a cluster.
- ``bench``: ``torchalpa bench``, torchalpa beside DDP and FSDP2 under torchrun (the
  scripts in ``benchmarks/`` share it).
"""

from torchalpa.cli.commands import main

__all__ = ["main"]
