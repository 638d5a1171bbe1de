"""The one error for "refused, with a reason code": bad events, bad work items, inputs outside
the rules and media that cannot (or may not) be decoded all raise Refused. The stage runtime
turns it into a dead letter carrying `reason` (a stable code) and `detail` (for people)."""

from __future__ import annotations


class Refused(ValueError):
    """Input that can never be processed; `reason` is a stable code for the dead-letter topic."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Raised inside decode worker processes and pickled back: keep both fields.
        return type(self), (self.reason, self.detail)


# The runtime's name for it (dead-letter path): the same class.
BadMessage = Refused
