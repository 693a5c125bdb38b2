"""``python -m torchalpa ...``: the ``torchalpa`` command (``torchalpa.cli``)."""

import sys

from torchalpa.cli import main

if __name__ == "__main__":
    sys.exit(main())
