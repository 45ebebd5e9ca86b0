"""octavo's tpu platform plugin."""
