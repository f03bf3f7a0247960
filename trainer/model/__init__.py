"""Models: the architectures, the untrained and the trained model directory, and a user's own
scripted model (layout.py tells which a folder is, without torch)."""
