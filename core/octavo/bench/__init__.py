"""``octavo bench``: offline throughput, online serving, batch latency and start-up measurements."""
