"""The progress bar of long data work (convert, extract, pack): tqdm when it is installed."""


def progress_bar(items, desc: str, unit: str, progress: bool | None):
    """`items` wrapped in a tqdm bar; `progress` None shows it only on a terminal.

    tqdm is optional: the GPU images have torch but not tqdm, and the items come back as they are.
    """
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit=unit, disable=None if progress is None else not progress)
