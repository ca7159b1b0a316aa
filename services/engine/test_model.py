"""Build a tiny random-weight Llama with a locally trained tokenizer, in Hugging Face format, for real-engine tests.

Job: `build_test_model(out_dir, ...)` writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json
(with a chat template),
special_tokens_map.json and generation_config.json; vLLM (CPU or CUDA) loads the folder as an ordinary Llama.

Invariants:
- No hub access: HF_HUB_OFFLINE is set before transformers is imported, the tokenizer is trained from an embedded
  corpus, and nothing is downloaded.
- Deterministic: the same arguments give byte-identical weights and the same tokenizer (seeded torch generator,
  seeded corpus generator).
- Token ids 0..vocab-1 all decode: the tokenizer vocabulary is padded with filler tokens up to `vocab`, so an
  engine can sample any id the model emits.
- Greedy output is not degenerate: weights are drawn with a large std (random Llamas at the usual 0.02 give
  near-uniform logits and one repeated token), and the EOS row of the output projection is zero, so EOS (logit 0
  among logits of spread ~±several) is practically never the argmax and tests run to max_tokens.
- Weights are float32, so greedy outputs of different batch shapes agree (bf16 ties would flip argmaxes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
# The model's chat template (tokenizer_config.json `chat_template`), used by octoserve's HTTP front and by vLLM's own
# OpenAI server alike: BOS, then each message as <|role|> + newline + content + <|end|>, then the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2 in this order

# Syllables for the synthetic corpus: enough distinct words that BPE learns thousands of merges.
_SYLLABLES = (
    "ka ri to na me su lo vi da pe zu mo ti ga ne ru sa po li ve "
    "ba de fi go hu ja ke la mi no pu qua re si tu va we xi yo ze "
    "an en in on un ar er ir or ur al el il ol ul ash esh ish osh ush"
).split()
_SEED_TEXT = (
    "The scheduler admits a request when the KV cache has room for its prompt and reservation. "
    "Prefill computes the prompt in chunks under a token budget; decode adds one token per step. "
    "A router scores instances by predicted time to first token and picks the lowest. "
    "Requests of the interactive tier are served before the batch tier when both wait. "
    "def step(self, now): plan = self.schedule(now); return self.update(plan, self.execute(plan), now)\n"
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.72 (a, b) [x, y] {k: v} <tag> a+b=c; x*y/z-1\n"
)


def _corpus(seed: int, num_lines: int = 3000) -> list[str]:
    """A deterministic synthetic corpus: the seed text plus lines of made-up words and numbers."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    lines = [_SEED_TEXT] * 20
    for _ in range(num_lines):
        n = rng.randint(6, 18)
        line = " ".join(rng.choice(words) for _ in range(n))
        lines.append(line.capitalize() + rng.choice((".", "!", "?", ",", ";")) + f" {rng.randint(0, 9999)}")
    return lines


def build_tokenizer(vocab: int, seed: int = 0):
    """Train a byte-level BPE of exactly `vocab` ids (filler tokens pad what training did not reach)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    missing = vocab - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|filler_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab}: raise the vocab size")
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Prepend BOS like Llama tokenizers do; byte-level post-processing keeps offsets right.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos_id)]),
        ]
    )
    return tok


def _llama_config(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, max_position: int, ids: dict,
                  *, intermediate: int | None = None, rope_theta: float = 10000.0, dtype: str = "float32"):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        tie_word_embeddings=False,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        torch_dtype=dtype,
        initializer_range=0.02,
    )


def _randomize(model, seed: int, eos_id: int) -> None:
    """Seeded weights with a std large enough for prompt-dependent, non-repeating greedy output."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            fan_in = param.shape[-1]
            # std ~1/sqrt(fan_in) keeps activations O(1) through the layers; embeddings get std 1.
            std = 1.0 if "embed_tokens" in name else 1.0 / fan_in**0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        model.lm_head.weight[eos_id].zero_()
        # Larger output scale spreads the logits so argmax gaps dwarf float reordering noise.
        model.lm_head.weight.mul_(4.0)


def _write_tokenizer_files(out: Path, tok, max_position: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_position,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def build_test_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 4096,
    max_position: int = 2048,
) -> Path:
    """Write the model folder and return its path. Safe to call again on the same folder (overwrites)."""
    out, tok, ids = _start_model_dir(out_dir, vocab, seed)
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    config = _llama_config(hidden, layers, heads, kv_heads, vocab, max_position, ids)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    _randomize(model, seed, ids["eos"])
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(out)
    _write_tokenizer_files(out, tok, max_position)
    return out


def _start_model_dir(out_dir: str | os.PathLike, vocab: int, seed: int):
    """(folder, tokenizer, its special ids) for a model folder about to be written; offline Hugging Face."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab, seed)
    ids = {"bos": tok.token_to_id(BOS_TOKEN), "eos": tok.token_to_id(EOS_TOKEN), "pad": tok.token_to_id(PAD_TOKEN)}
    return out, tok, ids


def build_shape_only_model(
    out_dir: str | os.PathLike,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    max_position: int,
    rope_theta: float = 500000.0,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """A model folder with config.json, generation_config.json and a locally trained tokenizer of exactly `vocab`
    ids, but no weight files: for vLLM's `load_format="dummy"` (random weights of the config's shape, drawn by the
    engine), so a real shape such as Llama-3-8B's is timed without writing 16 GB of weights."""
    out, tok, ids = _start_model_dir(out_dir, vocab, seed)
    from transformers import GenerationConfig

    config = _llama_config(hidden, layers, heads, kv_heads, vocab, max_position, ids, intermediate=intermediate,
                           rope_theta=rope_theta, dtype=dtype)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(out)
    _write_tokenizer_files(out, tok, max_position)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="folder to write the model into (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary of the locally trained BPE tokenizer")
    parser.add_argument("--max-position", type=int, default=2048, help="context window, tokens")


def run(args: argparse.Namespace) -> int:
    path = build_test_model(
        args.out_dir,
        seed=args.seed,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        max_position=args.max_position,
    )
    print(f"test model written to {path}")
    return 0
