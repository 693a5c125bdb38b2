"""Unknown keywords of a method's options, answered with where they belong.

``AutoParallel(memory_budget_per_device=...)`` is a natural guess, but the budget is an
``AutoShardingOption`` field: a dataclass's own ``__init__`` answers only "unexpected
keyword argument". ``names_misplaced_keywords`` wraps a method's ``__init__`` so an unknown
keyword is refused with the option record that holds it (and how to pass that record),
or with the closest field names of the method itself.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from dataclasses import fields

__all__ = ["names_misplaced_keywords"]


def _init_fields(cls) -> list[str]:
    return [f.name for f in fields(cls) if f.init]


def misplaced_message(cls, key: str, homes: dict[str, type]) -> str:
    """Why ``cls(key=...)`` is refused and what to write instead; ``homes`` maps a field
    of ``cls`` (``auto_sharding_option``) to the option record it takes."""
    own = _init_fields(cls)
    for attribute, record in homes.items():
        if attribute in own and key in _init_fields(record):
            head = f"{cls.__name__}() has no field {key!r}: it is a field of {record.__name__}"
            if _presets(cls, attribute, record):    # keep the preset's settings
                return (f"{head}; pass {cls.__name__}({attribute}=dataclasses.replace("
                        f"{cls.__name__}().{attribute}, {key}=...))")
            return f"{head}; pass {cls.__name__}({attribute}={record.__name__}({key}=...))"
    near = difflib.get_close_matches(key, own, n=3)
    hint = f"did you mean {', '.join(near)}?" if near else f"its fields: {', '.join(own)}"
    return f"{cls.__name__}() has no field {key!r}; {hint}"


def _presets(cls, attribute: str, record: type) -> bool:
    """Whether ``cls`` sets its own ``attribute`` record (DataParallel, Zero3Parallel):
    then a new record must start from it, or the preset's settings are lost."""
    default = cls.__dataclass_fields__[attribute].default_factory
    return default() != record()


def names_misplaced_keywords(homes: Callable[[], dict[str, type]]):
    """A class decorator (outside ``@dataclass``): unknown keywords raise ``TypeError``
    naming where they belong (``misplaced_message``; ``homes()`` is read then, so it may
    name records defined after the class)."""
    def wrap(cls):
        init = cls.__init__

        @functools.wraps(init)
        def checked(self, *args, **kwargs):
            known = set(_init_fields(cls))
            for key in kwargs:
                if key not in known:
                    raise TypeError(misplaced_message(cls, key, homes()))
            init(self, *args, **kwargs)

        cls.__init__ = checked
        return cls
    return wrap
