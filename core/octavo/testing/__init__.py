"""Test support shipped with octavo: the platform conformance suite and its pytest plugin."""
