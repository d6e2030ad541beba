"""Named marker values."""

from __future__ import annotations


class Sentinel:
    """A marker distinct from every other value, whose ``repr`` says what it marks.

    Example:
        >>> UNSEEN = Sentinel("unseen")
        >>> UNSEEN, UNSEEN is Sentinel("unseen")
        (<unseen>, False)
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"
