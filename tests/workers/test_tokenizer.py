"""The front's tokenizers: the reference model's bytes, and a Hugging Face tokenizer (the locally made
tiny Llama's) decoded piece by piece as answers stream."""

import json
import shutil

import pytest

from tiercake.tokenizer import ByteTokenizer, HfTokenizer, chat_text, load_tokenizer
from tiercake.workers.vllm.tiny_model import make_tiny_llama

TEXT = "Tiers: gpu → pool → SSD. Größe 4 KiB, 日本語 ✓ done"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def streamed(tok, ids: list[int]) -> list[str]:
    text = tok.detokenizer()
    return [text.feed(t) for t in ids] + [text.rest()]


def test_bytes_round_trip_and_a_cut_character_shows_as_a_replacement():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert "".join(streamed(tok, ids)) == TEXT
    cut = tok.encode("✓")[:2]  # two of the three bytes of one character
    assert streamed(tok, cut) == ["", "", "\ufffd"]


def test_a_hugging_face_tokenizer_streams_whole_characters_only(model_dir):
    tok = HfTokenizer(model_dir)
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode())  # merged pieces, not bytes
    pieces = streamed(tok, ids)
    assert "".join(pieces) == tok.tok.decode(ids, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in p for p in pieces)  # a character split across tokens waits for its end
    assert all(tok.token_text(t) for t in ids) and tok.token_bytes(ids[0]) == list(tok.tok.decode([ids[0]]).encode())


def test_chat_uses_the_models_template_when_it_has_one(model_dir, tmp_path):
    plain = HfTokenizer(model_dir)
    messages = [("system", "Be brief."), ("user", "Which tier?")]
    assert plain.chat(messages) == plain.encode(chat_text(messages))  # no template: the documented one
    templated = tmp_path / "templated"
    shutil.copytree(model_dir, templated)
    config = json.loads((templated / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    assert HfTokenizer(templated).chat(messages) == plain.encode("[system] Be brief.\n[user] Which tier?\n[assistant] ")


def test_a_missing_tokenizer_directory_is_a_clear_config_error(tmp_path):
    with pytest.raises(ValueError, match="serving.tokenizer: no tokenizer at"):
        load_tokenizer(tmp_path / "nowhere", 256)
    assert isinstance(load_tokenizer(None, 256), ByteTokenizer)
