"""The engine's tokenizer: transformers' tokenizer on a first load, a cached backend that
tokenizes exactly as it does on later loads (without importing transformers), and the errors."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys

import pytest

from octavo.errors import ConfigError
from octavo.model_executor.tokenizer import (
    GENERIC_TOKENIZER_CLASSES,
    Tokenizer,
    hf_tokenizer,
    load_hf_tokenizer,
    load_tokenizer,
)

TEXTS = [
    "the little cat ran home.",
    "<s>Once upon</s> a time",
    "",
    "  two  spaces\n\nand a tab\t",
    "unicode: naïve café — ☃ 你好",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "tokenizers"


@pytest.fixture
def llama_copy(tiny_models, tmp_path):
    """A private copy of the tiny Llama folder that a test may change."""
    return shutil.copytree(tiny_models["LlamaForCausalLM"], tmp_path / "model")


def assert_tokenizes_like(ours: Tokenizer, theirs) -> None:
    """Same ids, text and special tokens as the transformers tokenizer, for every text."""
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == theirs.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                )
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.chat_template == theirs.chat_template


@pytest.mark.parametrize("which", ["tiny", "demo", "stories260k"])
def test_a_cached_tokenizer_tokenizes_as_transformers_does(which, tiny_models, request, cache_dir):
    from octavo.entrypoints.openai.serve import demo_model_path

    if which == "stories260k":  # a LlamaTokenizer: transformers adds BOS in its post-processor
        folder = request.getfixturevalue("stories260k_path")
    else:
        folder = tiny_models["LlamaForCausalLM"] if which == "tiny" else demo_model_path()
    theirs = load_hf_tokenizer(folder)
    cold = load_tokenizer(folder, cache_dir)
    assert isinstance(cold, Tokenizer) and len(list(cache_dir.iterdir())) == 1
    warm = load_tokenizer(folder, cache_dir)
    assert isinstance(warm, Tokenizer) and warm._hf is None
    assert_tokenizes_like(cold, theirs)
    assert_tokenizes_like(warm, theirs)
    assert warm._hf is None  # encode, decode and special ids never loaded transformers
    again = pickle.loads(pickle.dumps(warm))  # as a tensor-parallel worker receives it
    assert_tokenizes_like(again, theirs)


def test_a_warm_load_does_not_import_transformers(tiny_models, cache_dir):
    """The start-up saving itself, in a fresh interpreter (nothing else imported it first)."""
    path = tiny_models["LlamaForCausalLM"]
    load_tokenizer(path, cache_dir)
    code = (
        "import sys\n"
        "from octavo.model_executor.tokenizer import load_tokenizer\n"
        f"tokenizer = load_tokenizer({str(path)!r}, {str(cache_dir)!r})\n"
        "tokenizer.encode('the cat'), tokenizer.decode([5, 6])\n"
        "print(type(tokenizer).__name__, 'transformers' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Tokenizer", "False"]


def test_transformers_loads_when_asked(server_like_folder, cache_dir):
    load_tokenizer(server_like_folder, cache_dir)
    tokenizer = load_tokenizer(server_like_folder, cache_dir)
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    theirs = load_hf_tokenizer(server_like_folder)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert hf_tokenizer(tokenizer) is tokenizer._hf is not None
    assert type(hf_tokenizer(tokenizer)) is type(theirs)


@pytest.fixture
def server_like_folder(llama_copy):
    """The tiny Llama with a chat template."""
    config_path = llama_copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"
    config_path.write_text(json.dumps(config))
    return llama_copy


def test_a_changed_tokenizer_file_is_a_cache_miss(llama_copy, cache_dir):
    before = load_tokenizer(llama_copy, cache_dir)
    assert before.encode("the cat")[0] == before.bos_token_id
    tokenizer_json = json.loads((llama_copy / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = None  # no BOS added any more
    (llama_copy / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    after = load_tokenizer(llama_copy, cache_dir)
    assert after._hf is not None and len(list(cache_dir.iterdir())) == 2
    assert after.encode("the cat") == load_hf_tokenizer(llama_copy).encode("the cat")
    assert after.encode("the cat") == before.encode("the cat")[1:]


def test_a_damaged_cache_file_is_rebuilt(llama_copy, cache_dir, caplog):
    load_tokenizer(llama_copy, cache_dir)
    (cache_file,) = cache_dir.iterdir()
    cache_file.write_text('{"backend_json": "not a tokenizer"')
    tokenizer = load_tokenizer(llama_copy, cache_dir)
    assert "ignoring the tokenizer cache file" in caplog.text
    assert_tokenizes_like(tokenizer, load_hf_tokenizer(llama_copy))
    assert isinstance(load_tokenizer(llama_copy, cache_dir), Tokenizer)
    assert json.loads(cache_file.read_text())["eos_token_id"] == tokenizer.eos_token_id


def test_a_tokenizer_that_cleans_up_spaces_is_not_cached(llama_copy, cache_dir):
    """Its decode is not the backend's, so it stays transformers' own."""
    config_path = llama_copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["clean_up_tokenization_spaces"] = True
    config_path.write_text(json.dumps(config))
    tokenizer = load_tokenizer(llama_copy, cache_dir)
    assert not isinstance(tokenizer, Tokenizer) and hf_tokenizer(tokenizer) is tokenizer
    assert not cache_dir.exists()


def test_an_unwritable_cache_only_costs_the_next_start(llama_copy, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    tokenizer = load_tokenizer(llama_copy, blocker / "cache")  # a folder inside a file
    assert_tokenizes_like(tokenizer, load_hf_tokenizer(llama_copy))


def test_tiny_model_tokenizer_covers_the_vocabulary(tiny_models):
    tokenizer = load_hf_tokenizer(tiny_models["LlamaForCausalLM"])
    assert len(tokenizer) == 512
    ids = tokenizer("the little cat ran home.").input_ids
    assert (
        ids[0] == 1
        and tokenizer.decode(ids, skip_special_tokens=True) == "the little cat ran home."
    )
    assert tokenizer.decode([511])  # filler ids decode to something


def test_generic_tokenizer_is_loaded_as_auto_tokenizer_loads_it(llama_copy):
    """A folder naming the generic tokenizer.json class skips AutoTokenizer (which reads the model
    config first) and gets the very tokenizer AutoTokenizer builds; other classes still go
    through AutoTokenizer."""
    from transformers import AutoTokenizer

    for name in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        config = json.loads((llama_copy / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = name
        (llama_copy / "tokenizer_config.json").write_text(json.dumps(config))
        ours = load_hf_tokenizer(llama_copy)
        theirs = AutoTokenizer.from_pretrained(str(llama_copy), local_files_only=True)
        assert type(ours) is type(theirs)
        assert ours.all_special_tokens == theirs.all_special_tokens and len(ours) == len(theirs)
        for text in TEXTS:
            ids = ours(text).input_ids
            assert ids == theirs(text).input_ids
            assert ours.decode(ids) == theirs.decode(ids)


def test_generic_tokenizer_loads_without_the_model_config_modules(tiny_models):
    """Loading such a tokenizer imports none of transformers' AutoConfig machinery (a fresh
    interpreter, so nothing else imported it first)."""
    path = tiny_models["LlamaForCausalLM"]
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        GENERIC_TOKENIZER_CLASSES
    )
    code = (
        "import sys\n"
        "from octavo.model_executor.tokenizer import load_hf_tokenizer\n"
        f"load_hf_tokenizer({str(path)!r})\n"
        "print('transformers.models.auto.configuration_auto' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_missing_tokenizer(llama_copy, cache_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (llama_copy / name).unlink()
    with pytest.raises(ConfigError, match="cannot load the tokenizer"):
        load_tokenizer(llama_copy, cache_dir)
