"""Tokenizer folders with real-world-style chat templates, built offline for the tests.

``save_tokenizer_folder(folder, family)`` trains a small byte-level BPE (a few hundred
tokens, well under the ``tiny`` model's vocabulary, so a CLI run can train on it) whose
special tokens are those of the family, and saves it the way ``transformers`` saves a
tokenizer: ``tokenizer.json`` plus ``tokenizer_config.json`` with ``added_tokens_decoder``
and the special tokens. The chat template goes where the caller asks: inside
``tokenizer_config.json`` (as a string or a list of named templates), or in a
``chat_template.jinja`` file next to it (transformers 4.43+).

The three templates in ``tests/assets/chat_templates`` were written for these tests in the
shape of Llama 3 (header turns, no generation blocks, no pad token), ChatML / Qwen2.5 (no
bos, a default system turn, ``{% generation %}`` blocks, a ``tool`` role) and Gemma 3 (the
system message folded into the first user turn, ``model`` as the assistant role,
alternation enforced by ``raise_exception``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "assets" / "chat_templates"


@dataclass(frozen=True)
class Family:
    name: str
    specials: tuple[str, ...]      # added as special tokens, in this order, at ids 0..
    bos: Optional[str]
    eos: Optional[str]
    pad: Optional[str]

    @property
    def template(self) -> str:
        return (TEMPLATE_DIR / f"{self.name}.jinja").read_text()


FAMILIES = {
    "llama3": Family("llama3", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|eot_id|>"), bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None),
    "chatml": Family("chatml", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None, eos="<|im_end|>",
                     pad="<|endoftext|>"),
    "gemma": Family("gemma", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), bos="<bos>",
                    eos="<eos>", pad="<pad>"),
}

TRAINING_TEXTS = [
    "What color is the sky? It is blue. And grass? Green, mostly.",
    "Be brief. You are a helpful assistant. The answer is four.",
    "Explain how a tokenizer splits text into tokens, then into ids.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Serialize obj to a JSON formatted str; deserialize s to a Python object.",
] * 20


def train_small_bpe(family: Family, vocab_size: int = 600) -> Tokenizer:
    """A deterministic byte-level BPE with the family's special tokens at ids 0..k-1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=[AddedToken(t, special=True, normalized=False) for t in family.specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXTS, trainer=trainer)
    if family.bos is not None:  # like Llama/Gemma: tokenizer(text) prepends bos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B:1",
            special_tokens=[(family.bos, tok.token_to_id(family.bos))])
    return tok


def tokenizer_config(family: Family, tok: Tokenizer, template) -> dict:
    """``tokenizer_config.json`` as ``transformers`` writes it (``added_tokens_decoder`` included)."""
    decoder = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": True} for t in family.specials}
    config = {"added_tokens_decoder": decoder, "tokenizer_class": "PreTrainedTokenizerFast",
              "bos_token": family.bos, "eos_token": family.eos, "clean_up_tokenization_spaces": False,
              "model_max_length": 4096}
    if family.pad is not None:
        config["pad_token"] = family.pad
    if template is not None:
        config["chat_template"] = template
    return config


def save_tokenizer_folder(folder: Path, family: str | Family, *, template_in: str = "config",
                          template: Optional[str] = None) -> Path:
    """Write a tokenizer folder for ``family``; returns ``folder``.

    ``template_in``: ``"config"`` (a string in tokenizer_config.json), ``"jinja"``
    (``chat_template.jinja``), ``"named"`` (a list of named templates in the config, the
    family's as ``default``), or ``"none"``. ``template`` replaces the family's template.
    """
    family = FAMILIES[family] if isinstance(family, str) else family
    text = family.template if template is None else template
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_small_bpe(family)
    tok.save(str(folder / "tokenizer.json"))
    in_config = {"config": text, "named": [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
                                           {"name": "default", "template": text}]}.get(template_in)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(family, tok, in_config), indent=2))
    if template_in == "jinja":
        (folder / "chat_template.jinja").write_text(text)
    return folder


def reference_render(template: str, messages: list[dict], add_generation_prompt: bool = False,
                     **special: str) -> str:
    """Render with plain jinja2 (transformers' settings), not twinseq's code: the test's oracle.

    ``{% generation %}`` tags are removed from the source first; they only mark spans.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    source = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", template)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)


def special_kwargs(family: Family) -> dict[str, str]:
    out = {"bos_token": family.bos or "", "eos_token": family.eos or ""}
    if family.pad:
        out["pad_token"] = family.pad
    return out
