"""Random-initialised Qwen3 checkpoints for the benchmarks, built here (nothing from a hub).

    SHAPES                                  layer sizes of the shapes the benchmarks name
    build_random_qwen3(shape, path)         bf16 weights + a word-level tokenizer ("t1 t2 ..."; serving)
    build_random_qwen3(shape, path, chat=True, vocab_size=QWEN3_VOCAB_SIZE)
                                            bf16 weights + a byte-level BPE tokenizer with Qwen3's special
                                            tokens and chat template (training: prompts are conversations)
    PseudoLanguage(num_words, seed)         the generated language the BPE is trained on; `text(n)` makes
                                            prompts in it

The BPE is trained on text of a pseudo-language: words of 2-4 syllables, drawn with Zipf frequencies
from a lexicon sized to the vocabulary, so that merging reaches the vocabulary size with whole words
as tokens and prompt text tokenizes like natural text (about 1.2 tokens per word). Everything is
seeded: the same arguments build the same files.

"0.6b" keeps the 32000-token vocabulary of the serving results already committed; pass
`vocab_size=QWEN3_VOCAB_SIZE` for the real Qwen3 embedding and LM-head size.
"""

from __future__ import annotations

import functools
import itertools
import random
from pathlib import Path

import torch

SHAPES = {
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000,
             "tie_word_embeddings": True},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
             "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
           "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": True},
}
QWEN3_VOCAB_SIZE = 151936  # Qwen3's embedding rows (its tokenizer: 151669 tokens)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen3's control tokens
TEXT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS] + [
    c + v + e for c in _CONSONANTS for v in _VOWELS for e in "nrst"
]


class PseudoLanguage:
    """`num_words` distinct pseudo-words with Zipf weights (1 / (rank + 10)); seeded."""

    def __init__(self, num_words: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        words: set[str] = set()
        while len(words) < num_words:
            words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))))
        self.words = sorted(words)
        rng.shuffle(self.words)
        self.cum_weights = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(num_words)))

    def sample(self, rng: random.Random, n: int) -> list[str]:
        return rng.choices(self.words, cum_weights=self.cum_weights, k=n)

    def text(self, rng: random.Random, num_words: int) -> str:
        return " ".join(self.sample(rng, num_words))

    def corpus(self, rng: random.Random, num_drawn: int, line_words: int = 1000):
        """Lines of text: every word of the lexicon twice (so each can become a token) and `num_drawn`
        Zipf draws, shuffled."""
        words = self.words + self.words + self.sample(rng, num_drawn)
        rng.shuffle(words)
        for start in range(0, len(words), line_words):
            yield " ".join(words[start : start + line_words])


@functools.lru_cache(maxsize=1)
def language_for_vocab(vocab_size: int, seed: int = 0) -> PseudoLanguage:
    """The language the chat tokenizer of `vocab_size` tokens is trained on (enough words to fill it)."""
    return PseudoLanguage(int(vocab_size * 1.3) + 1000, seed)


@functools.lru_cache(maxsize=1)  # two shapes of one vocabulary share it (training takes seconds)
def chat_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE of at most `vocab_size` tokens (specials included) trained on the pseudo-language,
    with Qwen3's special tokens and its chat template (the bundled training template)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from asyncgrpo.data.chat_templates import QWEN3, training_template

    added = len(SPECIAL_TOKENS) + len(TEXT_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - added, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    language = language_for_vocab(vocab_size, seed)
    tok.train_from_iterator(language.corpus(random.Random(seed), num_drawn=3 * len(language.words)), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = training_template(QWEN3)
    return fast


def word_tokenizer(vocab_size: int):
    """Words "t1".."t{V-1}" and "<eos>" = 0 (the serving benchmarks send token ids, not text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def build_random_qwen3(shape: str, path: Path, *, chat: bool = False, vocab_size: int | None = None,
                       device: str = "cpu", seed: int = 0) -> None:
    """Write a random-initialised Qwen3 of `shape` in bf16 and its tokenizer to `path`.

    `chat`: the BPE chat tokenizer (else the word-level one); `vocab_size`: embedding rows (default:
    the shape's); `device`: where the weights are initialised (a GPU initialises a 1.7B in a second,
    a CPU takes a minute)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = {**SHAPES[shape], "vocab_size": vocab_size or SHAPES[shape]["vocab_size"]}
    if chat:
        tokenizer = chat_tokenizer(cfg["vocab_size"], seed)
        eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
        assert len(tokenizer) <= cfg["vocab_size"], (len(tokenizer), cfg["vocab_size"])
    else:
        tokenizer = word_tokenizer(cfg["vocab_size"])
        eos = pad = 0
    config = Qwen3Config(**cfg, max_position_embeddings=40960, eos_token_id=eos, pad_token_id=pad,
                         dtype="bfloat16")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # free the GPU for the server and the trainer that load it next
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(path)
