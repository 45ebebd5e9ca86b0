"""octavo's cuda platform plugin."""
