"""Helpers of scripts/train_demo_model.py: corpus, tokenizer, training loop, report."""
