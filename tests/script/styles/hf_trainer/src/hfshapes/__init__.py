"""Tiny shapes, told apart by a tiny ViT (hfshapes.train)."""
