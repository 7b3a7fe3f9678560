"""Progress bars for the long steps (reference.load, diagnose, the default model's assembly).

A bar is drawn with tqdm on stderr when `progress` is True, or when it is None (the default of
every function that takes it) and stderr is a terminal; it stays quiet when stderr is piped or
redirected, when progress=False, and everywhere when QWENCUDA_PROGRESS=0.
"""
import os
import sys

from tqdm import tqdm


def enabled(progress=None) -> bool:
    """Whether a bar should be drawn for this `progress` argument."""
    if os.environ.get("QWENCUDA_PROGRESS", "").strip() == "0":
        return False
    if progress is None:
        stream = sys.stderr
        return bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
    return bool(progress)


def bar(total, desc, progress=None, unit="it"):
    """A tqdm bar (a context manager with .update) that is disabled unless enabled(progress)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                disable=not enabled(progress), dynamic_ncols=True)
