"""Kernel references shared by every platform."""
