"""The embedded byte-level BPE and the tokenizer wrapper: ids, round trips, chat masks, loading."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from twinseq.common.data import tokenizer as T

TEXTS = [
    "Return the sum of a and b.",
    "def f(x):\n    return x ** 2  # squared\n",
    "  leading spaces, trailing tabs\t\t",
    "unicode: héllo wörld ☃ 日本語 🙂",
    "special tokens inline: <s> and </s>",
    "",
]

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Explain `json.dumps`."},
    {"role": "assistant", "content": "Serialize obj to a JSON formatted str."},
    {"role": "user", "content": "And loads?"},
    {"role": "assistant", "content": " Deserialize s.\n"},
]


def test_special_tokens_and_vocab(embedded_tokenizer):
    tok = embedded_tokenizer
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.vocab_size == len(tok) == 8192
    assert [tok.backend.token_to_id(t) for t in T.SPECIAL_TOKENS] == list(range(6))
    assert tok.chat_template and "generation" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(embedded_tokenizer, text):
    ids = embedded_tokenizer.encode(text)
    assert all(0 <= i < embedded_tokenizer.vocab_size for i in ids)
    assert embedded_tokenizer.decode(ids) == text


def test_encode_adds_nothing_unless_asked(embedded_tokenizer):
    ids = embedded_tokenizer.encode("hello world")
    assert ids and ids[0] != 1 and ids[-1] != 2
    assert embedded_tokenizer.encode("hello world", add_special_tokens=True) == [1] + ids
    assert embedded_tokenizer.encode_batch(["hello world", "x"]) == [ids, embedded_tokenizer.encode("x")]


def test_bpe_compresses_the_corpus(embedded_tokenizer, embedded_sft):
    text = "\n".join(embedded_sft["completion"][:200])
    assert len(text) / len(embedded_tokenizer.encode(text)) > 3.0  # characters per token


def test_training_is_deterministic_across_processes(embedded_tokenizer, twinseq_cache):
    """A second build in a fresh process gives a byte-identical tokenizer.json."""
    folder = T.embedded_tokenizer_dir()
    code = ("import sys; from twinseq.common.data import corpus, tokenizer as T; "
            "sys.stdout.write(T.train_bpe(corpus.tokenizer_training_texts()).to_str())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    on_disk = T.Tokenizer.from_file(str(folder / "tokenizer.json")).to_str()
    assert out == on_disk


def test_chat_mask_covers_exactly_the_assistant_turns(embedded_tokenizer):
    tok = embedded_tokenizer
    ids, mask = tok.apply_chat_template(CHAT)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert ids[0] == tok.bos_token_id
    # the masked-in tokens, run by run, decode to each assistant message plus eos
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    expected = [m["content"] + "</s>" for m in CHAT if m["role"] == "assistant"]
    assert [tok.decode(r) for r in runs] == expected
    assert tok.decode(ids).startswith("<s><|system|>\nBe brief.</s><|user|>\n")


def test_generation_prompt(embedded_tokenizer):
    ids, mask = embedded_tokenizer.apply_chat_template(CHAT[:2], add_generation_prompt=True)
    assert embedded_tokenizer.decode(ids).endswith("<|assistant|>\n")
    assert not any(mask)


def test_template_without_generation_block_gives_the_same_mask(embedded_tokenizer):
    plain = embedded_tokenizer.chat_template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    assert "endgeneration" not in plain
    other = T.TwinseqTokenizer(embedded_tokenizer.backend, {**embedded_tokenizer.config, "chat_template": plain})
    assert other.apply_chat_template(CHAT) == embedded_tokenizer.apply_chat_template(CHAT)


def test_save_and_load_round_trip(embedded_tokenizer, tmp_path):
    files = embedded_tokenizer.save_pretrained(tmp_path / "tok")
    assert sorted(p.split("/")[-1] for p in files) == ["tokenizer.json", "tokenizer_config.json"]
    again = T.load_tokenizer(str(tmp_path / "tok"))
    for text in TEXTS:
        assert again.encode(text) == embedded_tokenizer.encode(text)
    assert again.apply_chat_template(CHAT) == embedded_tokenizer.apply_chat_template(CHAT)
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)


def test_transformers_loads_the_same_tokenizer(embedded_tokenizer):
    transformers = pytest.importorskip("transformers")
    folder = T.embedded_tokenizer_dir()
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, len(hf)) == (0, 1, 2, 8192)
    for text in TEXTS[:5]:
        assert hf(text, add_special_tokens=False)["input_ids"] == embedded_tokenizer.encode(text)
        assert hf(text)["input_ids"] == embedded_tokenizer.encode(text, add_special_tokens=True)
    out = hf.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = embedded_tokenizer.apply_chat_template(CHAT)
    assert list(out["input_ids"]) == ids
    assert list(out["assistant_masks"]) == mask


def test_hub_cache_snapshot_is_used(embedded_tokenizer, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    embedded_tokenizer.save_pretrained(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    tok = T.load_tokenizer("acme/tiny")
    assert tok.encode("hello") == embedded_tokenizer.encode("hello")


def test_legacy_config_fields(embedded_tokenizer, tmp_path):
    """Special tokens as dicts, a list of named templates, and no pad token (pads with eos)."""
    folder = tmp_path / "legacy"
    embedded_tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["bos_token"] = {"content": "<s>", "lstrip": False}
    config["pad_token"] = None
    config["chat_template"] = [{"name": "default", "template": config["chat_template"]}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = T.load_tokenizer(str(folder))
    assert (tok.bos_token_id, tok.pad_token_id) == (1, 2)
    assert tok.apply_chat_template(CHAT) == embedded_tokenizer.apply_chat_template(CHAT)
