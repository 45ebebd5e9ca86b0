"""``octavo train-draft``: draft heads trained on the CPU from their target's own outputs."""
