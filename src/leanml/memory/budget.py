"""The memory budget: parsed once, turned into bytes against one unoptimized peak.

A budget is either a fraction of the unoptimized activation peak (``0.5``, ``"0.5"``) or an absolute
size (``"2GB"``, ``"512MiB"``, ``"3000000B"``; from Python also a number above 1, ``3_000_000``, read as
bytes). A string is what a command line passes: a bare number in it above 1 (``"2.0"``, ``"3000000"``) is
refused, since ``--memory-budget 2.0`` was meant as something else than 2 bytes; give a fraction in
(0, 1] or a size with a unit. :meth:`Budget.parse` reads it once, where it enters the
library (``Adacc(budget=...)``, the ``--memory-budget`` option of ``TrainConfig``); everything downstream
passes the :class:`Budget` on and converts it with :meth:`Budget.to_bytes` against the one unoptimized
peak that the block-by-block profile computes for the input shape being planned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from leanml.errors import LeanmlError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class Budget:
    """``kind`` is ``"fraction"`` (``value`` in (0, 1]) or ``"bytes"`` (``value`` > 1)."""

    kind: str
    value: float

    @classmethod
    def parse(cls, spec: BudgetLike) -> Budget:
        """Read a budget: a :class:`Budget`, a number (a fraction when <= 1, else bytes) or a string
        (a fraction ``"0.5"``, or a size with its unit: ``"2GB"``, ``"512MiB"``, ``"3000000B"``). Raises
        :class:`LeanmlError` on anything else, including a string holding a bare number above 1."""
        if isinstance(spec, Budget):
            return spec
        if isinstance(spec, str):
            m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", spec)
            if not m or m.group(2).lower() not in _UNITS:
                raise LeanmlError(f"cannot read memory budget {spec!r}; use a fraction like 0.5, bytes, or a size "
                                  "like 2GB")
            value, unit = float(m.group(1)), m.group(2).lower()
            if unit == "":
                if value > 1:
                    raise LeanmlError(
                        f"memory budget {spec!r} has no unit; give a fraction of the unoptimized peak in (0, 1] "
                        f"(like 0.5) or a size with its unit (like 2GB, 512MiB or {spec.strip()}B for bytes)")
                return cls.parse(value)
            return cls.parse(value * _UNITS[unit]) if value * _UNITS[unit] > 1 else cls._bad(spec)
        if isinstance(spec, bool) or not isinstance(spec, (int, float)) or not spec > 0 or spec != spec:
            return cls._bad(spec)
        if spec <= 1.0:
            return cls("fraction", float(spec))
        return cls("bytes", float(spec))

    @staticmethod
    def _bad(spec: object) -> Budget:
        raise LeanmlError(f"memory budget must be positive, got {spec!r}; use a fraction like 0.5 or a size like 2GB")

    def to_bytes(self, unoptimized_peak: float) -> float:
        """The budget in bytes for a step whose unoptimized activation peak is ``unoptimized_peak``."""
        return self.value * unoptimized_peak if self.kind == "fraction" else self.value

    def fraction_of(self, unoptimized_peak: float) -> float:
        """The budget as a fraction of ``unoptimized_peak``."""
        return self.value if self.kind == "fraction" else self.value / max(unoptimized_peak, 1.0)

    def label(self) -> str:
        """``"50%"`` or ``"2.00 GB"``."""
        return f"{self.value:.0%}" if self.kind == "fraction" else f"{self.value / 1e9:.2f} GB"

    def cli_text(self) -> str:
        """The budget as :meth:`parse` reads it back (``"0.5"``, ``"2000000000B"``)."""
        return repr(self.value) if self.kind == "fraction" else f"{self.value:.0f}B"

    def to_json(self) -> dict[str, float | str]:
        return {"kind": self.kind, "value": self.value}


BudgetLike = Budget | float | int | str

#: the budget of ``leanml train`` and ``leanml recover`` when none is given: half the unoptimized peak
DEFAULT_BUDGET = Budget("fraction", 0.5)
