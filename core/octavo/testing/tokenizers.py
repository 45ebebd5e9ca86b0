"""A small byte-level BPE tokenizer built in memory, for detokenisation and output tests.

Its vocabulary is small on purpose: English words merge into whole tokens, while CJK characters
and emoji stay split into their UTF-8 bytes, so a character spans several tokens.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
_CORPUS = (
    "Once upon a time there was a little girl named Lily. She loved to play outside in the park.",
    "The quick brown fox jumps over the lazy dog. The end.",
    "Hello world! Stop here. STOP. The answer is 42.",
    "日本語 😀 café naïve",
)


def byte_level_bpe(vocab_size: int = 320) -> Tokenizer:
    """A trained byte-level BPE ``tokenizers.Tokenizer``; ids 0/1/2 are the special unk/bos/eos."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 8, trainer=trainer)
    return tokenizer
