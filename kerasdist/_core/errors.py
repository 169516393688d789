"""The errors of failed collectives, by the core's status code
(ops/core/status.h): KerasdistError, and RanksLostError for a rank lost
with recovery in place (docs/failures-and-elastic.md, "Recovery in
place"). Standard library only; kerasdist._core.capi raises them."""


class KerasdistError(RuntimeError):
    """A collective failed; `code` is the core's status code."""

    def __init__(self, message, code=5):
        super().__init__(message)
        self.code = code


# The core's StatusCode kRanksLost, and what every message of one says.
RANKS_LOST_CODE = 6
RANKS_LOST_TEXT = "a rank of the job was lost"


class RanksLostError(KerasdistError):
    """A rank of the job was lost and the survivors re-form without it
    (recovery in place): every survivor's pending and later collectives
    fail with it until `kerasdist.init()` starts the runtime again, on the
    survivors. `kerasdist.elastic.run` catches it, restores the last commit
    and goes on at the new size."""

    def __init__(self, message, code=RANKS_LOST_CODE):
        super().__init__(message, code)


def ranks_lost_line(error):
    """The core's line of an error that says a rank was lost, alone: from
    a framework's error around it (TensorFlow's "Graph execution error:",
    XLA's "INTERNAL: kerasdist: ...", Keras' "Exception encountered when
    calling Dense.call()." with the message in bold around a sharded
    weight's gather), without the runtime's "kerasdist has shut down: "
    and its advice to call kerasdist.init() again, which recovery in
    place does."""
    import re

    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
             for line in str(error).strip().splitlines()] or [""]
    text = next((line for line in lines if RANKS_LOST_TEXT in line),
                lines[0])
    for marker in ("kerasdist has shut down: ", "kerasdist: "):
        if marker in text:
            text = text[text.index(marker) + len(marker):]
    hint = text.find(" Call kerasdist.init()")
    return text[:hint] if hint > 0 else text


def error(message, code):
    """The KerasdistError of a failed collective's message and code:
    RanksLostError for a lost rank."""
    if code == RANKS_LOST_CODE or RANKS_LOST_TEXT in message:
        return RanksLostError(message)
    return KerasdistError(message, code)
