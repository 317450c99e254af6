"""Frontends: PyTorch capture (``torch_fx``)."""
