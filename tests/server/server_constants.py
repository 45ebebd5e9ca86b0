"""Constants the server tests share (imported by name: every test folder has its own conftest)."""

MODEL_NAME = "tiny-llama"
ENGINE_DEFAULTS = dict(kv_cache_memory="8MiB", max_num_seqs=64, max_num_batched_tokens=512)
