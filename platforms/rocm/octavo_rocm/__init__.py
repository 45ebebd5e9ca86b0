"""octavo's rocm platform plugin."""
