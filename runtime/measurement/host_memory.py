"""This process's host memory: resident set size now, and its high-water mark.

Linux reports both in ``/proc/self/status`` (``VmRSS``, ``VmHWM``, file-backed pages a
mapping touched included) and lets a process reset its own high-water mark to the current
RSS (writing ``5`` to ``/proc/self/clear_refs``), so a phase's peak can be measured on its
own. Elsewhere the peak is ``resource.getrusage``'s ``ru_maxrss`` since the process
started, and cannot be reset (``reset_peak`` returns False then).
"""

from __future__ import annotations

import resource
import sys

__all__ = ["rss_bytes", "peak_rss_bytes", "reset_peak"]

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Resident set size now (None where the system does not say)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    """The resident set's high-water mark: since ``reset_peak`` where it worked, else
    since the process started."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024     # macOS says bytes


def reset_peak() -> bool:
    """Set the high-water mark to the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
