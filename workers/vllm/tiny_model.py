"""A small Llama in the Hugging Face layout, made locally: config, tokenizer and weights.

Nothing can be downloaded where tiercake's tests and benchmarks run, so they make their model: a
byte-level BPE tokenizer trained on a fixed text, a Llama config, and weights drawn from a fixed
seed. Every vLLM instance that loads the directory computes the same KV for the same tokens, which
is what sharing KV between instances needs. Made once per directory (a marker file says it is
complete).
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A tiered cache keeps blocks of attention state on "
    "the accelerator, in shared memory and on disk, and moves them to whoever needs them next. "
    "Conversations grow turn by turn; each turn repeats the whole history before adding a question. "
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation ,.;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~` and the "
    "alphabet abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ appear so every byte has a token."
)
DONE = ".tiercake-tiny-model"


def make_tiny_llama(
    path: str | Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """Write the model to ``path`` (kept if already complete) and return the path."""
    path = Path(path)
    spec = dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        max_positions=max_positions,
        seed=seed,
    )
    marker = path / DONE
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one shard of a small model: a bar says nothing
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 3,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    config = LlamaConfig(  # type: ignore[call-arg]  # torch_dtype: one of the fields every config takes as **kwargs
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.08,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return path


if __name__ == "__main__":
    import sys

    print(make_tiny_llama(sys.argv[1]))
