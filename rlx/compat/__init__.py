"""Boundary modules for third-party quirks, one per dependency (see STYLE.md)."""
