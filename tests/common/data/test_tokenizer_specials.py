"""Special tokens exactly as the checkpoint's own tokenizer adds them (issue 26, item 4.6).

Every row of every format is tokenised by twinseq and by ``transformers`` from the same folder, and the ids must
be equal: plain text as ``tokenizer(text + eos_token)`` (TRL appends eos), standard prompt-completion as
``tokenizer(prompt + completion + eos_token)`` with the prompt ids ``tokenizer(prompt)``, messages as
``apply_chat_template(messages)``, conversational prompt-completion as ``apply_chat_template(prompt +
completion)`` with the prompt ids ``apply_chat_template(prompt, add_generation_prompt=True)``, DPO prompts as
``tokenizer(prompt)`` and GRPO prompts as ``tokenizer(prompt)`` or ``apply_chat_template(prompt,
add_generation_prompt=True)``.

The folders: ``llama3`` (its bos ``<|begin_of_text|>`` is a chat token, added by the post-processor *and* written
by the chat template: a double bos shows here), ``gemma``, ``chatml`` (no bos), ``llama3`` without a
post-processor (its template writes the bos, ``tokenizer(text)`` adds none), and a GPT-2/Qwen-style folder whose
config names a bos that its post-processor never adds.
"""

from __future__ import annotations

import json

import pytest
from chat_fixtures import FAMILIES, save_tokenizer_folder

from twinseq.common.data.prepare import tokenize_dpo, tokenize_sft
from twinseq.common.data.prompts import tokenize_prompts
from twinseq.common.data.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What color is the sky?"}
BLUE = {"role": "assistant", "content": "It is blue."}
GREEN = {"role": "assistant", "content": "It is green."}
MORE = [{"role": "user", "content": "And grass?"}, {"role": "assistant", "content": "Green, mostly."}]

TEXTS = ["What color is the sky? It is blue.", "The quick brown fox jumps over the lazy dog near the river bank.",
         "Explain how a tokenizer splits text into tokens, then into ids."]
PROMPT_COMPLETION = {"prompt": ["What color is the sky?", "Serialize obj to a JSON formatted str;"],
                     "completion": [" It is blue.", " deserialize s to a Python object."]}
MESSAGES = [[SYSTEM, USER, BLUE], [USER, BLUE, *MORE]]
CONV_PROMPT_COMPLETION = {"prompt": [[SYSTEM, USER], [USER, BLUE, MORE[0]]], "completion": [[BLUE], [MORE[1]]]}
PREFERENCE = {"prompt": ["What color is the sky?"], "chosen": [" It is blue."], "rejected": [" It is green."]}
CONV_PREFERENCE = {"prompt": [[SYSTEM, USER]], "chosen": [[BLUE]], "rejected": [[GREEN]]}

VARIANTS = ("llama3", "gemma", "chatml", "llama3-no-post-processor", "bos-not-added")


def _edit_config(folder, **changes):
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """variant -> (twinseq tokenizer, transformers tokenizer) of the same folder."""
    root, out = tmp_path_factory.mktemp("specials"), {}
    for variant in VARIANTS:
        folder = save_tokenizer_folder(root / variant, variant.split("-")[0] if variant != "bos-not-added"
                                       else "chatml")
        if variant == "llama3-no-post-processor":
            spec = json.loads((folder / "tokenizer.json").read_text())
            (folder / "tokenizer.json").write_text(json.dumps({**spec, "post_processor": None}))
        if variant == "bos-not-added":  # GPT-2 / Qwen style: a bos token that tokenizer(text) never adds
            _edit_config(folder, bos_token="<|endoftext|>")
        out[variant] = (load_tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(str(folder)))
    return out


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


def _chat(hf, messages, **kw) -> list[int]:
    return _ids(hf.apply_chat_template(messages, tokenize=True, **kw))


def test_the_folders_are_what_they_claim(pairs):
    llama, hf = pairs["llama3"]
    assert hf("sky")["input_ids"][0] == llama.bos_token_id == 0
    assert _chat(hf, [USER])[:2] == [0, llama.encode("<|start_header_id|>")[0]]  # the template writes one bos
    assert pairs["llama3-no-post-processor"][1]("sky")["input_ids"][0] != 0
    assert _chat(pairs["llama3-no-post-processor"][1], [USER])[0] == 0
    tok, hf = pairs["bos-not-added"]
    assert tok.bos_token_id is not None and tok.bos_token_id not in hf("sky")["input_ids"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_plain_text_rows_are_the_tokenizers_own(pairs, variant):
    tok, hf = pairs[variant]
    rows, _ = tokenize_sft({"text": TEXTS}, tok)
    assert [list(r) for r in rows["input_ids"]] == [_ids(hf(t + hf.eos_token)) for t in TEXTS]


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompt_completion_rows_are_the_tokenizers_own(pairs, variant):
    tok, hf = pairs[variant]
    rows, _ = tokenize_sft(PROMPT_COMPLETION, tok)
    for row, p, c in zip(rows, PROMPT_COMPLETION["prompt"], PROMPT_COMPLETION["completion"]):
        prompt_ids = _ids(hf(p))
        assert row["input_ids"] == _ids(hf(p + c + hf.eos_token))
        assert row["input_ids"][: len(prompt_ids)] == prompt_ids
        assert row["completion_mask"] == [0] * len(prompt_ids) + [1] * (len(row["input_ids"]) - len(prompt_ids))


@pytest.mark.parametrize("variant", VARIANTS)
def test_messages_rows_are_apply_chat_template(pairs, variant):
    tok, hf = pairs[variant]
    rows, _ = tokenize_sft({"messages": MESSAGES}, tok)
    assert [list(r) for r in rows["input_ids"]] == [_chat(hf, m) for m in MESSAGES]


@pytest.mark.parametrize("variant", VARIANTS)
def test_conversational_prompt_completion_rows_are_apply_chat_template(pairs, variant):
    tok, hf = pairs[variant]
    rows, _ = tokenize_sft(CONV_PROMPT_COMPLETION, tok)
    for row, p, c in zip(rows, CONV_PROMPT_COMPLETION["prompt"], CONV_PROMPT_COMPLETION["completion"]):
        prompt_ids = _chat(hf, p, add_generation_prompt=True)
        assert row["input_ids"] == _chat(hf, p + c)
        assert row["completion_mask"].index(1) == len(prompt_ids)
        assert row["input_ids"][: len(prompt_ids)] == prompt_ids


@pytest.mark.parametrize("variant", VARIANTS)
def test_preference_rows_are_the_tokenizers_own(pairs, variant):
    tok, hf = pairs[variant]
    row = tokenize_dpo(PREFERENCE, tok)[0][0]
    assert row["prompt_input_ids"] == _ids(hf(PREFERENCE["prompt"][0]))
    for key in ("chosen", "rejected"):
        assert row[f"{key}_input_ids"] == _ids(hf(PREFERENCE[key][0] + hf.eos_token, add_special_tokens=False))
    row = tokenize_dpo(CONV_PREFERENCE, tok)[0][0]
    prompt = CONV_PREFERENCE["prompt"][0]
    assert row["prompt_input_ids"] == _chat(hf, prompt, add_generation_prompt=True)
    for key in ("chosen", "rejected"):
        assert row["prompt_input_ids"] + row[f"{key}_input_ids"] == _chat(hf, prompt + CONV_PREFERENCE[key][0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_grpo_prompts_are_the_tokenizers_own(pairs, variant):
    """A text prompt as ``tokenizer(prompt)`` (what ``generate(**tokenizer(prompt))`` starts from); a conversation
    through the chat template with its generation prompt, one bos."""
    tok, hf = pairs[variant]
    rows = tokenize_prompts([{"prompt": "Repeat the last word: file value node\nAnswer:"},
                             {"prompt": [SYSTEM, USER]}, {"prompt": [USER, BLUE, MORE[0]]}], tok)
    assert rows[0]["prompt_input_ids"] == _ids(hf(rows[0]["prompt"]))
    for row in rows[1:]:
        assert row["prompt_input_ids"] == _chat(hf, row["prompt"], add_generation_prompt=True)


def test_the_embedded_tokenizer_keeps_its_bos(embedded_tokenizer):
    """The embedded tokenizer's post-processor adds ``<s>``: plain text is ``[<s>] + text + [</s>]`` as before."""
    assert embedded_tokenizer.text_affixes == ([embedded_tokenizer.bos_token_id], [])
    rows, _ = tokenize_sft({"text": ["def f(): pass"]}, embedded_tokenizer)
    ids = rows[0]["input_ids"]
    assert ids[0] == embedded_tokenizer.bos_token_id and ids[-1] == embedded_tokenizer.eos_token_id
    assert ids[1:-1] == embedded_tokenizer.encode("def f(): pass")


def test_a_text_ending_in_eos_gets_no_second_one(pairs):
    tok, hf = pairs["llama3"]
    rows, _ = tokenize_sft({"text": [TEXTS[0] + hf.eos_token]}, tok)
    assert rows[0]["input_ids"] == _ids(hf(TEXTS[0] + hf.eos_token))


def test_lengths_takes_the_runs_tokenizer(pairs, tmp_path, capsys):
    """``twinseq lengths --model-config DIR`` counts in the model folder's own tokens, as ``twinseq train`` would."""
    from twinseq.common.data.lengths import main

    folder = save_tokenizer_folder(tmp_path / "model", "llama3")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in MESSAGES))
    assert main([str(data), "--model-name-or-path", str(folder), "--no-plot", "--candidates", "16,64"]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer {str(folder)!r}" in out
    hf = pairs["llama3"][1]
    longest = max(len(_chat(hf, m)) for m in MESSAGES)
    assert f"max={longest}" in out
    run = tmp_path / "run.yaml"
    run.write_text(f"model_config: {folder}\ndataset_name: {data}\nper_device_train_batch_size: 2\n")
    assert main(["--config", str(run), "--no-plot", "--candidates", "16,64"]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer {str(folder)!r}" in out and f"max={longest}" in out and "batches of 2" in out
