"""Plans for people: text summaries and explanations, HTML pictures, Chrome traces.

Importing this package registers those views with ``torchalpa.core.plan`` (so that
``Plan.summary()``, ``explain``, ``to_html`` and ``to_chrome_trace`` find them).

- ``report``: ``summary()``, ``explain(name)`` and ``explain_choice()``.
- ``pictures``: one self-contained HTML page, and a Chrome/Perfetto trace.
- ``fold``: repeated layers folded (``layers.{0..31}.mlp.up_proj.weight ... x32``).

Layers, data flow, and where to add things: docs/architecture.md.
"""

from torchalpa.views import pictures, report

__all__ = ["pictures", "report"]
