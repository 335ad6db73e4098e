"""Tokenizers for the diffusers fixtures, trained in code on a few sentences (no hub access)."""

from __future__ import annotations

import json
from typing import Any

#: Text the tokenizers are trained on; prompts in tests come from the same words.
SENTENCES = [
    "a photo of a cat sitting on a red chair",
    "an oil painting of a lighthouse by the sea at night",
    "a capybara wearing a wizard hat, reading a book by candlelight",
    "a small robot watering plants in a green house",
    "blurry, low quality, distorted, watermark, text",
    "Comprehend and analyze the provided prompt.",
    "the quick brown fox jumps over the lazy dog",
]


# --- tokenizers ----------------------------------------------------------------------------


def _train_bpe(
    specials: list[str], *, vocab_size: int = 400, end_of_word_suffix: str | None = None
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE on SENTENCES; returns (vocab, merges) for a transformers tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    model = (
        models.BPE(end_of_word_suffix=end_of_word_suffix) if end_of_word_suffix else models.BPE()
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    extra = {}
    if end_of_word_suffix:
        extra["end_of_word_suffix"] = end_of_word_suffix
        alphabet = alphabet + [c + end_of_word_suffix for c in alphabet]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
        **extra,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    spec = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    return spec["vocab"], merges


def _train_unigram(specials: list[str], *, vocab_size: int = 200) -> list[tuple[str, float]]:
    """Train a sentencepiece-style Unigram on SENTENCES; returns [(piece, score)] for T5."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=specials, unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return [(piece, float(score)) for piece, score in json.loads(tok.to_str())["model"]["vocab"]]


def clip_tokenizer(max_length: int = 77) -> Any:
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    vocab, merges = _train_bpe(specials, end_of_word_suffix="</w>")
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def t5_tokenizer(max_length: int = 512) -> Any:
    from transformers import T5TokenizerFast

    vocab = _train_unigram(["<pad>", "</s>", "<unk>"])
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=max_length)


#: Qwen chat markers the Qwen-Image pipelines format prompts with.
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The Qwen2-VL chat template, reduced to what text prompts with typed content need.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer() -> Any:
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_bpe(QWEN_SPECIALS)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=1024)
    # Registered as special, so each marker is one token and never split into bytes.
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    return tokenizer
