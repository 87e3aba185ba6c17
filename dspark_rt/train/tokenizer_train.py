"""A byte-level BPE tokenizer trained with `tokenizers`, saved as a Hugging Face tokenizer folder:
tokenizer.json + tokenizer_config.json (ChatML Jinja chat template) + chat_template.jinja.

Special tokens: <|endoftext|> (document separator and eos), <|im_start|> / <|im_end|> (ChatML)
and <|mask|> (the drafter's mask token). The vocabulary is padded with <|reserved_i|> tokens to
exactly `vocab` ids, so the model's vocab_size equals the tokenizer's.
"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["train_tokenizer", "save_tokenizer", "load_tokenizer", "SPECIAL_TOKENS", "CHAT_TEMPLATE"]

# The tiny pair's special tokens and ChatML template; the test fixtures write the same ones
# (dspark_rt/testing/fixtures.py imports them from here).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def train_tokenizer(texts, vocab: int = 2048) -> Tokenizer:
    if vocab < 256 + len(SPECIAL_TOKENS) + 16:
        raise ValueError(f"vocab={vocab} is too small for a byte-level BPE (>= 288)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=True)
    tok.train_from_iterator(texts, trainer)
    n = tok.get_vocab_size()
    if n < vocab:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab - n)])
    return tok


def save_tokenizer(tok: Tokenizer, path, max_len: int):
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja into path."""
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
           "bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
           "additional_special_tokens": SPECIAL_TOKENS[1:], "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)


def load_tokenizer(path) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))


def special_ids(tok: Tokenizer) -> dict:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
