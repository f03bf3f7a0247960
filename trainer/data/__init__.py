"""Image directories: the format every step shares, convert, split, pack, decoding, transforms
and loaders."""
