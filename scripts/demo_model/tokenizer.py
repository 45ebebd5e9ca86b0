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
# for the server's /v1/chat/completions, not a skill the model has. With ``tools`` it renders them
# the Hermes way (a system turn listing them in <tools></tools>; an assistant's calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>; tool results as <tool_response> in a
# user turn), the format octavo's built-in "hermes" tool parser reads and constrains. Without
# tools or tool messages it renders exactly the plain ChatML turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions. Their signatures, within <tools></tools>:"
    "\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each call, return a JSON object with the function name and arguments "
    'within <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% if not loop.first or message['content'] %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
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
