"""Plans for people: text summaries and explanations, HTML pictures, Chrome traces.

Importing this package registers those views with ``torchalpa.core.plan`` (so that
``Plan.summary()``, ``explain``, ``to_html`` and ``to_chrome_trace`` find them).

Layers, data flow, and where to add things: docs/architecture.md.
"""

from torchalpa.views import pictures, report

__all__ = ["pictures", "report"]
