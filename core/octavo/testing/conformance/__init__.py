"""The platform conformance suite: ``pytest --pyargs octavo.testing.conformance --octavo-platform NAME``."""
