"""Estimation: prompt tokens and the bytes of VRAM one request needs."""
