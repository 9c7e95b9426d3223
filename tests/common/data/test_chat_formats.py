"""TRL's dataset formats, standard and conversational, through tokenize_sft / tokenize_dpo.

Each conversational case runs with the three real-world-style templates of ``chat_fixtures``
(Llama 3, ChatML/Qwen, Gemma shapes). The expected ids are built from first principles: the
prompt rendered with the generation prompt, encoded; the rest of the rendered conversation,
encoded. The decoded completions are spelled out per template.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from chat_fixtures import FAMILIES, reference_render, save_tokenizer_folder, special_kwargs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinseq.common.data.batching import IGNORE_INDEX, collate
from twinseq.common.config import TrainConfig
from twinseq.common.data.prepare import prepare_dpo_dataset, prepare_sft_dataset, tokenize_dpo, tokenize_sft
from twinseq.common.errors import TwinseqError
from twinseq.common.data.formats import shared_prefix_length
from twinseq.common.data.tokenizer import TwinseqTokenizer, load_tokenizer
from twinseq.common.data.truncation import DROP_EMPTY_COMPLETION, DROP_SAME_PAIR

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What color is the sky?"}
BLUE = {"role": "assistant", "content": "It is blue."}
GREEN = {"role": "assistant", "content": "It is green."}
MORE = [{"role": "user", "content": "And grass?"}, {"role": "assistant", "content": "Green, mostly."}]
# The completion text of [BLUE] after [SYSTEM, USER], as each template writes it.
BLUE_TEXT = {"llama3": "It is blue.<|eot_id|>", "chatml": "It is blue.<|im_end|>\n",
             "gemma": "It is blue.<end_of_turn>\n"}
GREEN_TEXT = {k: v.replace("blue", "green") for k, v in BLUE_TEXT.items()}
FAMILY_NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tokenizers")
    return {f: load_tokenizer(str(save_tokenizer_folder(root / f, f))) for f in FAMILY_NAMES}


def _expected_prompt_ids(tok: TwinseqTokenizer, family: str, prompt: list[dict]) -> list[int]:
    text = reference_render(FAMILIES[family].template, prompt, add_generation_prompt=True,
                            **special_kwargs(FAMILIES[family]))
    return tok.encode(text)


# --------------------------------------------------------------------------------------
# (b) conversational prompt-completion: loss on the completion only
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_conversational_prompt_completion_labels_only_the_completion(toks, family):
    tok = toks[family]
    prompts = [[SYSTEM, USER], [SYSTEM, USER, BLUE, MORE[0]]]
    completions = [[BLUE], [MORE[1]]]
    rows, stats = tokenize_sft({"prompt": prompts, "completion": completions}, tok)
    assert rows.column_names == ["input_ids", "completion_mask"] and stats.examples_kept == 2
    for row, prompt, completion in zip(rows, prompts, completions):
        p_ids = _expected_prompt_ids(tok, family, prompt)
        n = len(p_ids)
        assert row["input_ids"][:n] == p_ids
        assert row["completion_mask"] == [0] * n + [1] * (len(row["input_ids"]) - n)
        full = reference_render(FAMILIES[family].template, prompt + completion, **special_kwargs(FAMILIES[family]))
        assert tok.decode(row["input_ids"]) == full  # the conversation, nothing added or lost
    assert tok.decode(rows[0]["input_ids"][len(_expected_prompt_ids(tok, family, prompts[0])):]) == BLUE_TEXT[family]
    batch = collate(list(rows), pad_token_id=tok.pad_token_id)
    for b, row in enumerate(rows):
        targets = np.flatnonzero(batch.labels[b] != IGNORE_INDEX)
        assert targets.tolist() == np.flatnonzero(row["completion_mask"]).tolist()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_messages_and_prompt_completion_agree_on_the_conversation(toks, family):
    """The same conversation as 'messages' or as prompt/completion: the same text, and the
    completion mask covers the assistant answer that 'messages' masks (plus what the template
    writes after the generation block, such as ChatML's newline)."""
    tok = toks[family]
    as_messages, _ = tokenize_sft({"messages": [[SYSTEM, USER, BLUE]]}, tok)
    as_pc, _ = tokenize_sft({"prompt": [[SYSTEM, USER]], "completion": [[BLUE]]}, tok, assistant_only_loss=True)
    assert tok.decode(as_pc[0]["input_ids"]) == tok.decode(as_messages[0]["input_ids"])
    completion = [t for t, m in zip(as_pc[0]["input_ids"], as_pc[0]["completion_mask"]) if m]
    answer = [t for t, m in zip(as_pc[0]["input_ids"], as_pc[0]["assistant_masks"]) if m]
    assert tok.decode(answer) == tok.decode([t for t, m in zip(as_messages[0]["input_ids"],
                                                               as_messages[0]["assistant_masks"]) if m])
    assert tok.decode(completion).startswith(tok.decode(answer))


def test_assistant_only_loss_narrows_the_completion(toks):
    """ChatML's generation block stops before the newline: with assistant_only_loss the newline is no target."""
    tok = toks["chatml"]
    rows, _ = tokenize_sft({"prompt": [[USER]], "completion": [[BLUE]]}, tok, assistant_only_loss=True)
    batch = collate(list(rows), pad_token_id=tok.pad_token_id, assistant_only_loss=True)
    targets = batch.labels[0][batch.labels[0] != IGNORE_INDEX]
    assert tok.decode(targets) == "It is blue.<|im_end|>"
    full_loss, _ = tokenize_sft({"prompt": [[USER]], "completion": [[BLUE]]}, tok, completion_only_loss=False)
    batch = collate(list(full_loss), pad_token_id=tok.pad_token_id, completion_only_loss=False)
    assert (batch.labels != IGNORE_INDEX).sum() == len(full_loss[0]["input_ids"]) - 1  # all but the first token


def test_embedded_template_prompt_completion_equals_messages(embedded_tokenizer):
    """With twinseq's own template the boundary falls between tokens: identical ids and masks."""
    messages, _ = tokenize_sft({"messages": [[USER, BLUE]]}, embedded_tokenizer)
    pc, _ = tokenize_sft({"prompt": [[USER]], "completion": [[BLUE]]}, embedded_tokenizer)
    assert pc[0]["input_ids"] == messages[0]["input_ids"]
    assert pc[0]["completion_mask"] == messages[0]["assistant_masks"]


# --------------------------------------------------------------------------------------
# (c) conversational preference
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_conversational_preference(toks, family):
    tok = toks[family]
    data = {"prompt": [[SYSTEM, USER]], "chosen": [[BLUE]], "rejected": [[GREEN]]}
    rows, stats = tokenize_dpo(data, tok)
    row = rows[0]
    assert stats.examples_kept == 1
    assert row["prompt_input_ids"] == _expected_prompt_ids(tok, family, [SYSTEM, USER])
    assert tok.decode(row["chosen_input_ids"]) == BLUE_TEXT[family]  # no extra eos: the template ends the turn
    assert tok.decode(row["rejected_input_ids"]) == GREEN_TEXT[family]
    prompt_text = tok.decode(row["prompt_input_ids"])
    assert row["chosen_input_ids"] == tok.encode(tok.render_text([SYSTEM, USER, BLUE])[len(prompt_text):])
    # chosen and rejected documents share the one prompt
    from twinseq.common.data.preference_batching import collate_preference

    pb = collate_preference(list(rows), pad_token_id=tok.pad_token_id)
    ids = pb.batch.input_ids
    n = len(row["prompt_input_ids"])
    assert ids[0, :n].tolist() == ids[1, :n].tolist() == row["prompt_input_ids"]


# --------------------------------------------------------------------------------------
# (d) implicit prompts
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("chosen,rejected,n", [
    ("The sky is blue.", "The sky is green.", 10),   # the space goes to the completions
    ("Yes.", "Yes. Really.", 3),                     # each completion keeps at least one character
    ("ab", "ab", 1),
    ("Blue.", "Green.", 0),
    ([1, 2, 3], [1, 2, 4], 2),
    ([1, 2], [1, 2, 3], 1),
])
def test_shared_prefix_length(chosen, rejected, n):
    assert shared_prefix_length(chosen, rejected) == n


def test_standard_implicit_prompt(embedded_tokenizer):
    tok = embedded_tokenizer
    data = {"chosen": ["The sky is blue.", "Q: 2+2? A: 4"], "rejected": ["The sky is green.", "Q: 2+2? A: 5"]}
    rows, stats = tokenize_dpo(data, tok)
    assert stats.examples_kept == 2
    assert rows[0]["prompt_input_ids"] == [tok.bos_token_id] + tok.encode("The sky is")
    assert rows[0]["chosen_input_ids"] == tok.encode(" blue.") + [tok.eos_token_id]
    assert rows[0]["rejected_input_ids"] == tok.encode(" green.") + [tok.eos_token_id]
    explicit, _ = tokenize_dpo({"prompt": ["The sky is", "Q: 2+2? A:"], "chosen": [" blue.", " 4"],
                                "rejected": [" green.", " 5"]}, tok)
    assert rows.to_list() == explicit.to_list()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_conversational_implicit_prompt(toks, family):
    """chosen/rejected full conversations sharing [SYSTEM, USER, BLUE, MORE[0]]: the same rows as the explicit prompt."""
    tok = toks[family]
    shared = [SYSTEM, USER, BLUE, MORE[0]]
    answer_a, answer_b = MORE[1], {"role": "assistant", "content": "Purple."}
    implicit, stats = tokenize_dpo({"chosen": [shared + [answer_a]], "rejected": [shared + [answer_b]]}, tok)
    explicit, _ = tokenize_dpo({"prompt": [shared], "chosen": [[answer_a]], "rejected": [[answer_b]]}, tok)
    assert stats.examples_kept == 1 and implicit.to_list() == explicit.to_list()
    assert implicit[0]["prompt_input_ids"] == _expected_prompt_ids(tok, family, shared)


# --------------------------------------------------------------------------------------
# Drops, counted
# --------------------------------------------------------------------------------------


def test_conversational_drops_are_counted(toks):
    tok = toks["chatml"]
    empty = [{"role": "assistant", "content": "  "}]
    rows, stats = tokenize_sft({"prompt": [[USER], [USER]], "completion": [[BLUE], empty]}, tok)
    assert len(rows) == 1 and stats.dropped == {DROP_EMPTY_COMPLETION: 1}
    rows, stats = tokenize_dpo({"prompt": [[USER]] * 3, "chosen": [[BLUE], [BLUE], empty],
                                "rejected": [[GREEN], [BLUE], [GREEN]]}, tok)
    assert len(rows) == 1 and stats.dropped == {DROP_SAME_PAIR: 1, DROP_EMPTY_COMPLETION: 1}
    rows, stats = tokenize_dpo({"chosen": [[USER, BLUE], [USER, BLUE]], "rejected": [[USER, BLUE], [USER, GREEN]]},
                               tok)
    assert len(rows) == 1 and stats.dropped == {DROP_SAME_PAIR: 1}


# --------------------------------------------------------------------------------------
# (e) errors name the row and the field
# --------------------------------------------------------------------------------------

BAD_ROWS = {
    "role not in the template": ("sft", {"prompt": [[USER], [USER]],
                                         "completion": [[BLUE], [{"role": "gpt", "content": "x"}]]},
                                 r"row 1 \(line 2 of a JSONL file\): completion\[0\]\['role'\]='gpt' is not a role this "
                                 r"chat template handles.*'gpt'/'model'/'bot'->'assistant'"),
    "content not a string": ("sft", {"prompt": [[{"role": "user", "content": 5}]], "completion": [[BLUE]]},
                             r"row 0 .*: prompt\[0\]\['content'\] must be a string, got int"),
    "empty completion list": ("sft", {"prompt": [[USER]], "completion": [[]]},
                              r"row 0 .*: 'completion' must be a non-empty list of \{'role', 'content'\} dicts"),
    "message without role": ("dpo", {"prompt": [[USER]], "chosen": [[{"content": "x"}]], "rejected": [[GREEN]]},
                             r"row 0 .*: chosen\[0\] must be a dict with 'role' and 'content'"),
    "completion a string, prompt messages": ("sft", {"prompt": [[USER]], "completion": ["It is blue."]},
                                             r"row 0 .*: field 'prompt' must be a string, got list.*both 'prompt' and "
                                             r"'completion'"),
    "chosen messages, prompt a string": ("dpo", {"prompt": ["Q"], "chosen": [[BLUE]], "rejected": [[GREEN]]},
                                         r"row 0 .*: field 'chosen' must be a string, got list.*every one of 'prompt', "
                                         r"'chosen' and 'rejected'"),
    "template refuses the prompt": ("dpo", {"prompt": [[USER, USER]], "chosen": [[BLUE]], "rejected": [[GREEN]]},
                                    r"row 0 .*: the chat template refuses 'prompt': Conversation roles must alternate"),
    "no shared message": ("dpo", {"chosen": [[USER, BLUE]], "rejected": [[MORE[0], GREEN]]},
                          r"row 0 .*: 'chosen' and 'rejected' share no leading message.*add a 'prompt' column"),
    "no shared text": ("dpo", {"chosen": ["Blue."], "rejected": ["Green."]},
                       r"row 0 .*: 'chosen' and 'rejected' share no leading text"),
    "prompt-only data": ("sft", {"prompt": [[USER]]}, r"\['completion'\].*prompt-only data.*GRPO"),
    "preference data for sft": ("sft", {"prompt": ["Q"], "chosen": ["a"], "rejected": ["b"]}, r"--task dpo"),
    "unpaired preference": ("sft", {"prompt": ["Q"], "completion": ["a"], "label": [False]},
                            r"unpaired preference format \(KTO\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_malformed_conversational_rows(toks, case):
    task, data, fragment = BAD_ROWS[case]
    fn = tokenize_sft if task == "sft" else tokenize_dpo
    with pytest.raises((ValueError, TypeError), match=fragment) as err:
        fn(data, toks["gemma"])
    assert isinstance(err.value, TwinseqError) and "\n" not in str(err.value)


def test_prompt_not_a_prefix_of_the_conversation(embedded_tokenizer):
    """A template that marks the last turn renders the prompt differently once a completion follows."""
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %} [END]{% endif %}\n"
                "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    tok = TwinseqTokenizer(embedded_tokenizer.backend, {**embedded_tokenizer.config, "chat_template": template})
    with pytest.raises(ValueError, match=r"row 0 .*: the chat template renders 'prompt' \+ 'completion' so that it "
                                         r"does not start with the rendered prompt \(they differ at character 28.*"
                                         r"a .messages. column"):
        tokenize_sft({"prompt": [[USER]], "completion": [[BLUE]]}, tok)
    with pytest.raises(ValueError, match=r"row 0 .*'prompt' \+ 'chosen'"):
        tokenize_dpo({"prompt": [[USER]], "chosen": [[BLUE]], "rejected": [[GREEN]]}, tok)


# --------------------------------------------------------------------------------------
# Through the trainer entry points and the CLI (both backends call these functions)
# --------------------------------------------------------------------------------------


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-data")
    folder = save_tokenizer_folder(root / "tok-gemma", "gemma", template_in="jinja")
    sft = [{"prompt": [USER], "completion": [BLUE]}, {"prompt": [SYSTEM, USER], "completion": [GREEN]}] * 8
    dpo = [{"chosen": [SYSTEM, USER, BLUE], "rejected": [SYSTEM, USER, GREEN]}] * 8
    return {"tokenizer": str(folder), "sft": _jsonl(root / "sft.jsonl", sft), "dpo": _jsonl(root / "dpo.jsonl", dpo)}


def test_prepare_datasets_read_conversational_files(chat_files):
    cfg = TrainConfig.from_flat(dataset_name=chat_files["sft"], tokenizer_name_or_path=chat_files["tokenizer"],
                                max_length=64)
    rows, tok, stats = prepare_sft_dataset(cfg)
    assert rows.column_names == ["input_ids", "completion_mask"] and len(rows) == 16
    assert tok.decode(rows[0]["input_ids"]).startswith("<bos><start_of_turn>user\nWhat color")
    cfg = TrainConfig.from_flat(task="dpo", dataset_name=chat_files["dpo"],
                                tokenizer_name_or_path=chat_files["tokenizer"], max_length=64)
    rows, tok, stats = prepare_dpo_dataset(cfg)
    assert len(rows) == 8 and tok.decode(rows[0]["chosen_input_ids"]) == BLUE_TEXT["gemma"]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_cli_trains_on_conversational_files(chat_files, task, tmp_path):
    from twinseq.common.cli import main

    argv = ["train", "--backend", "torch", "--task", task, "--dataset-name", chat_files[task],
            "--tokenizer-name-or-path", chat_files["tokenizer"], "--model-config", "tiny", "--max-steps", "2",
            "--max-length", "64", "--per-device-train-batch-size", "2", "--output-dir", str(tmp_path / "out"),
            "--disable-tqdm"]
    assert main(argv) == 0
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(np.isfinite(json.loads(line)["loss"]) for line in lines)


# --------------------------------------------------------------------------------------
# Fuzz: any conversational rows either tokenise or raise one of twinseq's own errors
# --------------------------------------------------------------------------------------

# Mostly well-formed conversations (alternating turns, as Gemma's template demands), so that
# rendering, prefix extraction, drops and truncation are reached, plus arbitrary messages.
ROLES = st.sampled_from(["user", "assistant", "system", "tool", "human", "model", ""])
ANY_MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES, "content": st.one_of(st.text(max_size=8), st.none())}),
                        max_size=3)


def _turns(first: int):
    return st.lists(st.sampled_from(["", " ", "blue", "It is green.", "x\n", "<eos>", "\u00e9t\u00e9"]), min_size=1,
                    max_size=3).map(lambda texts: [{"role": ("user", "assistant")[(i + first) % 2], "content": t}
                                                   for i, t in enumerate(texts)])


PROMPTS, ANSWERS = st.one_of(_turns(0), _turns(0), ANY_MESSAGES), st.one_of(_turns(1), _turns(1), ANY_MESSAGES)
ROWS = {"sft": st.builds(lambda p, a: {"prompt": p, "completion": a}, PROMPTS, ANSWERS),
        "dpo": st.builds(lambda p, a, b: {"prompt": p, "chosen": a, "rejected": b}, PROMPTS, ANSWERS, ANSWERS),
        "implicit": st.builds(lambda p, a, b: {"chosen": p + a, "rejected": p + b}, PROMPTS, ANSWERS, ANSWERS)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(ROWS)), st.sampled_from(FAMILY_NAMES), st.data())
def test_any_conversational_rows(toks, scheme, family, data):
    rows = data.draw(st.lists(ROWS[scheme], min_size=1, max_size=3))
    fn = tokenize_sft if scheme == "sft" else tokenize_dpo
    try:
        out, stats = fn(rows, toks[family], max_length=48)
    except TwinseqError as err:
        assert str(err).strip() and "\n" not in str(err)
        return
    assert stats.examples_seen == len(rows) == len(out) + stats.examples_dropped


def test_prompt_ids_are_the_ids_generation_starts_from(embedded_tokenizer):
    """Where a BPE merge crosses the prompt/completion boundary (a Llama 3 shaped template ends
    its generation prompt with "\\n\\n"; the embedded GPT-2 style BPE merges "\\n\\n" only at the
    end of a text), the prompt ids are those of the prompt alone, not a slice of the whole
    conversation's ids (docs/data-formats.md)."""
    config = {**embedded_tokenizer.config, "chat_template": FAMILIES["llama3"].template}
    tok = TwinseqTokenizer(embedded_tokenizer.backend, config)
    prompt_text = tok.render_prompt([USER])
    whole = tok.encode(tok.render_text([USER, BLUE]))
    assert whole[:len(tok.encode(prompt_text))] != tok.encode(prompt_text)  # the merge crosses the boundary
    rows, _ = tokenize_sft({"prompt": [[USER]], "completion": [[BLUE]]}, tok)
    n = len(tok.encode(prompt_text))
    assert rows[0]["input_ids"][:n] == tok.encode(prompt_text)
    assert tok.decode(rows[0]["input_ids"]) == tok.decode(whole)  # the same text either way
    assert tok.decode(rows[0]["input_ids"][n:]) == "It is blue.<|eot_id|>"
