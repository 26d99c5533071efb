"""Adapters that put vispe encodings into other libraries' models (each imports its library lazily)."""
