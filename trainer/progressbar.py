"""The progress bar of long data work (convert, extract, pack): tqdm when it is installed."""

import sys


def progress_bar(items, desc: str, unit: str, progress: bool | None, total: int | None = None):
    """`items` wrapped in a tqdm bar; `progress` None shows it only on a terminal. `total`: how
    many items, where `items` has no length (an iterator).

    tqdm is optional: the GPU images have torch but not tqdm, and the items come back as they are.
    So they do where no bar would show (tqdm is not imported: 30 ms of a short command's start).
    """
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit=unit, total=total,
                disable=None if progress is None else not progress)
