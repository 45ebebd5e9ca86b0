"""A byte-level BPE tokenizer trained on the corpus, wrapped for transformers.

Byte-level BPE encodes any text losslessly (no unknown token), which matters for source code:
indentation, tabs and non-ASCII string literals all round-trip exactly.
"""

from __future__ import annotations

from typing import List, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Ids 0..4 in this order: config.json and generation_config.json rely on it.
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)

# A ChatML-style template: the model was trained on code only, so chat turns are a convenience
# for the server's /v1/chat/completions, not a skill the model has.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train byte-level BPE on ``texts``; encodings start with BOS (as every training file does)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> List[List[int]]:
    """Each text as ``BOS tokens... EOS``: the document boundaries the model learns."""
    eos_id = tokenizer.token_to_id(EOS)
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=True)
    return [encoding.ids + [eos_id] for encoding in encodings]


def to_transformers(tokenizer: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """The trained tokenizer as a transformers fast tokenizer with special tokens and chat
    template."""
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
