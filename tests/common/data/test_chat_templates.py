"""A local tokenizer folder's own chat template and special tokens are what twinseq uses.

Folders are built offline (``chat_fixtures``) with three templates in the shape of Llama 3,
ChatML/Qwen and Gemma, stored where transformers stores them: in tokenizer_config.json, in
chat_template.jinja, or as a list of named templates. The oracle is a plain jinja2
rendering of the template plus ``encode``; where transformers is installed it must agree too.
"""

from __future__ import annotations

import json
import logging

import pytest
from chat_fixtures import FAMILIES, reference_render, save_tokenizer_folder, special_kwargs

from twinseq.common.data.prepare import tokenize_sft
from twinseq.common.errors import DataError, TwinseqError
from twinseq.common.data.tokenizer import TwinseqTokenizer, load_tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What color is the sky?"},
    {"role": "assistant", "content": "It is blue."},
    {"role": "user", "content": "And grass?"},
    {"role": "assistant", "content": "Green, mostly.\n"},
]
# What each template writes for the two assistant turns (the assistant mask covers exactly these).
ASSISTANT_TEXT = {
    "llama3": ["It is blue.<|eot_id|>", "Green, mostly.<|eot_id|>"],
    "chatml": ["It is blue.<|im_end|>", "Green, mostly.\n<|im_end|>"],
    "gemma": ["It is blue.<end_of_turn>\n", "Green, mostly.<end_of_turn>\n"],
}
SPECIAL_IDS = {"llama3": (0, 4, 4), "chatml": (None, 2, 0), "gemma": (2, 1, 0)}  # bos, eos, pad


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{(family, where the template is stored): folder}``."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {(family, where): save_tokenizer_folder(root / f"{family}-{where}", family, template_in=where)
            for family in FAMILIES for where in ("config", "jinja", "named")}


def _runs(ids, mask):
    runs, current = [], []
    for token, bit in zip(ids, mask):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("where", ["config", "jinja", "named"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_folders_own_template_renders_messages(folders, family, where):
    """(a) ids of 'messages' data = encode(the template rendered by plain jinja2), wherever it is stored."""
    tok = load_tokenizer(str(folders[family, where]))
    fam = FAMILIES[family]
    assert tok.chat_template == fam.template
    assert tok.chat_template_source.endswith("chat_template.jinja" if where == "jinja" else "tokenizer_config.json")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == SPECIAL_IDS[family]
    rows, stats = tokenize_sft({"messages": [CHAT]}, tok)
    expected = tok.encode(reference_render(fam.template, CHAT, **special_kwargs(fam)))
    assert rows[0]["input_ids"] == expected and stats.examples_kept == 1
    assert [tok.decode(run) for run in _runs(expected, rows[0]["assistant_masks"])] == ASSISTANT_TEXT[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generation_prompt_and_continued_final_message(folders, family):
    tok = load_tokenizer(str(folders[family, "config"]))
    fam = FAMILIES[family]
    prompt = tok.render_prompt(CHAT[:4])
    assert prompt == reference_render(fam.template, CHAT[:4], add_generation_prompt=True, **special_kwargs(fam))
    prefilled = tok.render_prompt([*CHAT[:2], {"role": "assistant", "content": "It is "}])
    # the text stops inside the assistant turn: no end-of-turn after the prefilled words
    full = reference_render(fam.template, [*CHAT[:2], {"role": "assistant", "content": "It is blue."}],
                            **special_kwargs(fam))
    assert full.startswith(prefilled) and prefilled.rstrip().endswith("It is")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_agrees(folders, family):
    transformers = pytest.importorskip("transformers")
    folder = folders[family, "jinja"]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = load_tokenizer(str(folder))
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert hf.pad_token_id in (None, tok.pad_token_id)  # None: twinseq pads with eos, as TRL does
    assert hf.apply_chat_template(CHAT, tokenize=False) == tok.render_text(CHAT)
    assert list(hf.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]) == \
        tok.apply_chat_template(CHAT)[0]
    assert hf.apply_chat_template(CHAT[:4], tokenize=False, add_generation_prompt=True) == tok.render_prompt(CHAT[:4])
    prefilled = [*CHAT[:2], {"role": "assistant", "content": "It is "}]
    assert hf.apply_chat_template(prefilled, tokenize=False, continue_final_message=True) == tok.render_prompt(prefilled)
    if family == "chatml":  # the template with {% generation %} blocks
        out = hf.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert list(out["assistant_masks"]) == tok.apply_chat_template(CHAT)[1]


def test_missing_pad_token_falls_back_to_eos_with_a_log_line(folders, caplog):
    with caplog.at_level(logging.INFO, logger="twinseq.common.data.tokenizer"):
        tok = load_tokenizer(str(folders["llama3", "config"]))
    assert tok.pad_token == tok.eos_token == "<|eot_id|>" and tok.pad_token_id == tok.eos_token_id
    assert any("no pad token; padding with the eos token '<|eot_id|>'" in r.message for r in caplog.records)


def _edit_config(folder, **changes):
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_special_tokens_map_is_read_as_transformers_reads_it(tmp_path):
    """Without added_tokens_decoder (older saves) special_tokens_map.json overrides the config;
    with it, the map is ignored."""
    folder = save_tokenizer_folder(tmp_path / "legacy", "llama3")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"pad_token": {"content": "<|end_of_text|>", "lstrip": False}, "eos_token": "<|end_of_text|>"}))
    modern = load_tokenizer(str(folder))
    assert (modern.eos_token, modern.pad_token) == ("<|eot_id|>", "<|eot_id|>")
    _edit_config(folder, added_tokens_decoder=None)
    legacy = load_tokenizer(str(folder))
    assert (legacy.eos_token_id, legacy.pad_token_id) == (1, 1) and legacy.bos_token_id == 0
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 1)


def test_template_files_win_over_the_config(tmp_path):
    folder = save_tokenizer_folder(tmp_path / "both", "chatml", template_in="jinja")
    _edit_config(folder, chat_template="{{ raise_exception('the config template must not be used') }}")
    tok = load_tokenizer(str(folder))
    assert tok.chat_template == FAMILIES["chatml"].template
    extra = folder / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("{{ 'tools' }}")
    assert load_tokenizer(str(folder)).chat_template == FAMILIES["chatml"].template


def test_named_templates_without_default(tmp_path):
    folder = save_tokenizer_folder(tmp_path / "named", "gemma", template_in="none")
    _edit_config(folder, chat_template=[{"name": "rag", "template": "{{ 'x' }}"},
                                        {"name": "tool_use", "template": "{{ 'y' }}"}])
    tok = load_tokenizer(str(folder))  # loads: text data needs no template
    assert tok.chat_template is None
    with pytest.raises(DataError, match=r"chat templates named \['rag', 'tool_use'\] but none named 'default'"):
        tokenize_sft({"messages": [CHAT[1:3]]}, tok)


def test_no_template_at_all(tmp_path):
    tok = load_tokenizer(str(save_tokenizer_folder(tmp_path / "bare", "gemma", template_in="none")))
    with pytest.raises(DataError, match=r"has no chat_template; add one to its tokenizer_config\.json \(or a "
                                        r"chat_template\.jinja"):
        tokenize_sft({"messages": [CHAT[1:3]]}, tok)
    rows, _ = tokenize_sft({"text": ["It is blue."]}, tok)  # text data still works
    assert rows[0]["input_ids"][0] == tok.bos_token_id


@pytest.mark.parametrize("case,edit,fragment", [
    ("syntax error", {"chat_template": "{% for m in messages %}{{ m.content }}"},
     r"tokenizer_config\.json: the chat template does not compile: .*endfor"),
    ("bad template type", {"chat_template": 7}, r"chat_template must be a string or a list"),
    ("special token not in the vocabulary", {"pad_token": "<|pad|>"}, r"pad_token='<\|pad\|>' .* not in the vocabulary"),
])
def test_broken_folders_are_refused_at_load(tmp_path, case, edit, fragment):
    folder = save_tokenizer_folder(tmp_path / "broken", "llama3")
    _edit_config(folder, **edit)
    with pytest.raises(TwinseqError, match=fragment):
        load_tokenizer(str(folder))


@pytest.mark.parametrize("name,text,fragment", [
    ("tokenizer.json", '{"version": "1.0", "model": 3}', r"tokenizer\.json cannot be read by the tokenizers library"),
    ("tokenizer_config.json", "{not json", r"tokenizer_config\.json is not valid JSON"),
    ("special_tokens_map.json", "[1, 2]", r"special_tokens_map\.json holds a list, not a JSON object"),
])
def test_corrupt_files_are_refused_at_load(tmp_path, name, text, fragment):
    folder = save_tokenizer_folder(tmp_path / "corrupt", "chatml")
    _edit_config(folder, added_tokens_decoder=None)  # so that special_tokens_map.json is read
    (folder / name).write_text(text)
    with pytest.raises(TwinseqError, match=fragment):
        load_tokenizer(str(folder))


def test_roles_come_from_the_template(folders):
    """ChatML names a 'tool' role, so tool turns are allowed there and refused by the Llama 3 one."""
    chatml, llama3 = load_tokenizer(str(folders["chatml", "config"])), load_tokenizer(str(folders["llama3", "config"]))
    tool_chat = [CHAT[1], {"role": "tool", "content": "sky=blue"}, CHAT[2]]
    assert chatml.roles == ("system", "user", "assistant", "tool")
    assert "<tool_response>\nsky=blue\n</tool_response>" in chatml.render_text(tool_chat)
    with pytest.raises(DataError, match=r"row 4 \(line 5 of a JSONL file\): messages\[1\]\['role'\]='tool' is not a "
                                        r"role this chat template handles; use one of \('system', 'user', 'assistant'\)"):
        tokenize_sft({"messages": [CHAT[1:3]] * 4 + [tool_chat]}, llama3)


def test_template_refusal_names_the_row(folders):
    gemma = load_tokenizer(str(folders["gemma", "config"]))
    bad = [CHAT[1], CHAT[3], CHAT[2]]  # two user turns in a row
    with pytest.raises(DataError, match=r"row 1 \(line 2 of a JSONL file\): the chat template refuses 'messages': "
                                        r"Conversation roles must alternate"):
        tokenize_sft({"messages": [CHAT[1:3], bad]}, gemma)


def test_embedded_default_is_unchanged(embedded_tokenizer):
    """(f) the embedded tokenizer still renders with twinseq's own template, as before."""
    from twinseq.common.data.tokenizer import default_chat_template

    tok = embedded_tokenizer
    assert tok.chat_template == default_chat_template()
    assert tok.chat_template_source.startswith("the embedded default")
    assert tok.render_text(CHAT[1:3]) == "<s><|user|>\nWhat color is the sky?</s><|assistant|>\nIt is blue.</s>"
    assert tok.roles == ("system", "user", "assistant")


def test_in_memory_tokenizer_with_another_template(embedded_tokenizer):
    """A TwinseqTokenizer built in Python uses the template it is given."""
    fam = FAMILIES["chatml"]
    tok = TwinseqTokenizer(embedded_tokenizer.backend, {**embedded_tokenizer.config, "chat_template": fam.template})
    assert tok.render_text(CHAT[1:3]).startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_a_run_takes_the_model_folders_tokenizer_unless_told_otherwise(tmp_path, caplog):
    """``tokenizer_name_or_path`` None: a ``--model-config`` folder with a tokenizer.json brings its tokenizer
    (as a Hugging Face checkpoint does); a folder without one, or a preset, gets the embedded tokenizer;
    an explicit ``tokenizer_name_or_path`` wins over both."""
    from twinseq.common.config import TrainConfig
    from twinseq.common.data.prepare import run_tokenizer

    model = save_tokenizer_folder(tmp_path / "model", "chatml")
    (model / "config.json").write_text("{}")
    bare = tmp_path / "bare"
    bare.mkdir()
    embedded = len(load_tokenizer("embedded"))
    with caplog.at_level(logging.INFO, logger="twinseq.common.data.prepare"):
        assert len(run_tokenizer(TrainConfig.from_flat(model_config=str(model)))) == len(load_tokenizer(str(model)))
    assert f"the model folder's own ({model})" in caplog.text
    assert len(load_tokenizer(str(model))) != embedded
    assert len(run_tokenizer(TrainConfig.from_flat(model_config=str(bare)))) == embedded
    assert len(run_tokenizer(TrainConfig.from_flat(model_config="tiny"))) == embedded
    explicit = TrainConfig.from_flat(model_config=str(model), tokenizer_name_or_path="embedded")
    assert len(run_tokenizer(explicit)) == embedded
