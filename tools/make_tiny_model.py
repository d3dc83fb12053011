"""Build a tiny Llama model with real saved weights and a local byte-level BPE tokenizer.

Nothing is downloaded: the weights come from a seeded random initialisation and the tokenizer
is trained on built-in sentences. Same arguments give byte-identical files. Optionally one row
of the input embedding is set to NaN, so that any request containing that token produces
non-finite logits.

    python tools/make_tiny_model.py --out /tmp/tiny-llama [--seed 0] [--vocab-size 512]
                                    [--nan-token-id 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

STAMP_NAME = "ascend_guard_model.json"
# Bump when the files this script writes change, so old stamps stop matching.
FORMAT_VERSION = 1

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]  # ids 0, 1, 2, 3
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # byte alphabet plus the special tokens

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model can still answer a simple question.",
    "The weather today is sunny with a light breeze from the west.",
    "She opened the window and listened to the birds singing outside.",
    "Please summarise the following paragraph in one short sentence.",
    "The train to the city leaves every twenty minutes from platform two.",
    "He wrote a long letter to his grandmother about the summer holidays.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The library is open from nine in the morning until six in the evening.",
    "Our team finished the project two days before the deadline.",
    "Can you tell me how to get to the nearest train station?",
    "The children built a sandcastle on the beach near the harbour.",
    "Learning a new language takes patience, practice and curiosity.",
    "The server returned an error because the request was malformed.",
    "Every night the old lighthouse keeper climbed the stairs to light the lamp.",
    "The recipe calls for two eggs, a cup of flour and a pinch of salt.",
    "Mountains covered in snow rose above the quiet green valley.",
    "The meeting has been moved to Thursday afternoon at three o'clock.",
    "Scientists measured the temperature of the ocean at different depths.",
    "The cat slept in a warm patch of sunlight on the kitchen floor.",
    "Write a short poem about the moon and the stars.",
    "The museum displays paintings from many different centuries.",
    "He forgot his umbrella and walked home in the pouring rain.",
    "The garden was full of roses, tulips and bright yellow sunflowers.",
    "Please translate this sentence into French and German.",
    "The computer restarted after installing the latest updates.",
    "Fresh bread from the bakery smells wonderful in the morning.",
    "The river flows slowly through the old town and under the stone bridge.",
    "What is the capital city of the country with the most islands?",
    "They watched the sunset from the top of the hill behind the village.",
    "The doctor advised him to drink more water and sleep earlier.",
    "A good story has a beginning, a middle and an end.",
    "The orchestra played a beautiful symphony to a full concert hall.",
    "Numbers like one, two, three, four and five are easy to remember.",
    "The shop on the corner sells newspapers, coffee and fresh fruit.",
    "Birds fly south for the winter when the days grow shorter.",
    "The answer to the question depends on how you read it.",
    "Thank you for your help; I really appreciate your time.",
    "The old clock in the hall struck midnight as the guests departed.",
    "Engineers tested the bridge carefully before opening it to traffic.",
]


def _params(seed: int, vocab_size: int, nan_token_id: int | None) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "vocab_size": vocab_size,
        "nan_token_id": nan_token_id,
    }


def _is_built(out_dir: Path, params: dict[str, Any]) -> bool:
    stamp = out_dir / STAMP_NAME
    try:
        if json.loads(stamp.read_text()) != params:
            return False
    except (OSError, ValueError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
    return all((out_dir / name).is_file() for name in needed)


def _build_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE tokenizer with exactly `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    # Too few merges in the corpus for a large vocab: pad with plain filler tokens.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def _build_into(tmp: Path, seed: int, vocab_size: int, nan_token_id: int | None) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = _build_tokenizer(vocab_size)
    bos_id, eos_id, pad_id = (tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD))
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    config.dtype = "float32"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    if nan_token_id is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight[nan_token_id] = float("nan")
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    vocab_size: int = 512,
    nan_token_id: int | None = None,
) -> Path:
    """Build the tiny model into `out_dir` (skipped if already built with these parameters)."""
    out = Path(out_dir).resolve()
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    if nan_token_id is not None and not 0 <= nan_token_id < vocab_size:
        raise ValueError(f"nan_token_id {nan_token_id} is outside [0, {vocab_size})")
    params = _params(seed, vocab_size, nan_token_id)
    if _is_built(out, params):
        return out

    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP_NAME).unlink(missing_ok=True)
    # Build next to the target, then move file by file; the stamp goes last, so a stamp
    # means a complete model even if builds race or one is interrupted.
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=out.parent))
    try:
        _build_into(tmp, seed, vocab_size, nan_token_id)
        for item in sorted(tmp.iterdir()):
            item.chmod(0o644)
            os.replace(item, out / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (out / STAMP_NAME).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the weights")
    parser.add_argument("--vocab-size", type=int, default=512, help="tokenizer/model vocab")
    parser.add_argument(
        "--nan-token-id", type=int, default=None, help="set this input-embedding row to NaN"
    )
    args = parser.parse_args(argv)
    try:
        out = build_tiny_model(args.out, args.seed, args.vocab_size, args.nan_token_id)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"tiny model: {out}")


if __name__ == "__main__":
    main()
