"""The tiny randomly initialised Llama the end-to-end checks serve (`make test-e2e`,
`make test-sglang`), made here: no download, no hub access.

`make_model(path)` writes its config and float32 weights (safetensors) with transformers;
`tokenizer=True` adds a word-level tokenizer built locally with `tokenizers` (token i is the word
`t<i>`), for servers that load one. `prompts()` are token-id prompts of several lengths, some
repetitive, so that ngram speculative decoding finds drafts.
"""
from __future__ import annotations

from pathlib import Path

MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=1, eos_token_id=2)
SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}


def prompts(n: int = 16) -> list[list[int]]:
    """Token-id prompts of several lengths, some repetitive (ngram drafts find matches)."""
    out = []
    for i in range(n):
        length = 6 + 5 * i
        base = [3 + (11 * i + 5 * j) % 500 for j in range(4 + i)]
        out.append([1] + [base[j % len(base)] for j in range(length)])
    return out


def make_model(path: Path, tokenizer: bool = False) -> None:
    path = Path(path)
    if not (path / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**MODEL))
        model.save_pretrained(path)       # safetensors, float32
    if tokenizer and not (path / "tokenizer.json").exists():
        make_tokenizer(path)


def make_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = dict(SPECIAL)
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), MODEL["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
