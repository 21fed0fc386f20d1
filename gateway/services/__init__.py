"""Service functions: every database write goes through here (keyword-only ``session``).

The errors they raise live in :mod:`gateway.errors`.
"""
