"""Run llama.cpp's ``convert_hf_to_gguf.py`` on a benchmark model, knowing its pre-tokenizer.

    python gguf_convert.py LLAMA_CPP_TREE MODEL_DIR --outtype f32 --outfile MODEL.gguf

The converter writes which regular expressions llama.cpp splits text with before BPE
("tokenizer.ggml.pre"). It finds that by encoding a fixed text and looking the hash of the token
ids up in a table of known HuggingFace tokenizers, and stops ("BPE pre-tokenizer was not
recognized") on any other. The random-weight models of benchmarks/models.py have a tokenizer
trained for the tests (octavo.testing.tiny_models): byte-level BPE whose pre-tokenizer is
GPT-2's (ByteLevel, use_regex), so its hash is in no table. This wrapper answers "gpt-2" for an
unknown hash when the model's tokenizer.json pre-tokenizes that way, by wrapping the method (the
vendored file is left as it is), and then runs the converter as its own ``__main__``. The
benchmark's prompts are token ids, so the pre-tokenizer affects only how llama-server would
tokenize text, not what is measured.

A second wrap spares octavo's environment sentencepiece: the Llama converter tries a SentencePiece
``tokenizer.model`` first and imports sentencepiece before it looks for that file; these models have
none, so the wrap answers "no such file" (the converter's own signal to go on to tokenizer.json)
before the import.
"""

from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path

UNRECOGNISED = "BPE pre-tokenizer was not recognized"


def splits_like_gpt2(model: Path) -> bool:
    """Whether ``model``'s tokenizer.json pre-tokenizes as GPT-2's: ByteLevel with its regex."""
    path = model / "tokenizer.json"
    if not path.is_file():
        return False
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def main() -> None:
    tree = Path(sys.argv[1]).resolve()
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]  # its `conversion` package and gguf-py
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError as exc:
            if UNRECOGNISED not in str(exc) or not splits_like_gpt2(self.dir_model):
                raise
            logging.getLogger(__name__).warning(
                "unknown pre-tokenizer hash: using 'gpt-2' (the benchmark models' tokenizer splits "
                "like GPT-2's)"
            )
            return "gpt-2"

    sentencepiece_vocab = TextModel._create_vocab_sentencepiece

    def create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return sentencepiece_vocab(self)

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece
    script = tree / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *sys.argv[2:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
