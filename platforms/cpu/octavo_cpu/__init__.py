"""octavo's cpu platform: torch-native kernels, the default on machines without accelerators."""
