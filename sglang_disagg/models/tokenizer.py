"""An offline byte-level BPE tokenizer, trained deterministically on made-up words.

A byte-level alphabet means any text round-trips; training until the vocab is
exactly the model's vocab size means every id a random model emits decodes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def _corpus(n_words: int = 60000, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(n_words):
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        line.append(word.capitalize() if rng.random() < 0.1 else word)
        if len(line) >= 12:
            lines.append(" ".join(line) + rng.choice([".", ",", "?", "!", ";"]))
            line = []
    return lines


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    got = tok.get_vocab_size()
    if got != vocab_size:
        raise RuntimeError(f"tokenizer training produced {got} tokens, model needs {vocab_size}")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", 1)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}, indent=2) + "\n"
    )
