"""Build the testbed's tiny checkpoints, deterministically, from local material only.

This script runs with the vLLM environment's interpreter (it needs torch, tokenizers and
transformers, which specpilot itself does not depend on), so it imports nothing from
specpilot. ``testbed.models`` calls it and caches the result.

Output layout under ``OUT``:

- ``target/``: a small random ``LlamaForCausalLM`` with a BPE tokenizer trained here.
- ``draft-noise-<σ>/``: the target's weights plus Gaussian noise of σ times each tensor's
  standard deviation. σ = 0 accepts every greedy draft token; acceptance falls as σ grows,
  which lets tests dial it. Drafts share the target's tokenizer files byte for byte, as a
  real draft must.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
# What makes a tokenizer: a draft must carry these byte for byte as the target has them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

# A ChatML-like template: enough for /v1/chat/completions to work on the tiny model.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def train_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_target(spec: dict[str, int | float], vocab_size: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=int(spec["hidden_size"]),
        intermediate_size=int(spec["intermediate_size"]),
        num_hidden_layers=int(spec["num_hidden_layers"]),
        num_attention_heads=int(spec["num_attention_heads"]),
        num_key_value_heads=int(spec["num_attention_heads"]),
        max_position_embeddings=int(spec["max_position_embeddings"]),
        initializer_range=float(spec["initializer_range"]),
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model


def add_noise(model: LlamaForCausalLM, sigma: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if not tensor.is_floating_point() or tensor.numel() < 2:
                continue
            scale = float(tensor.std()) * sigma
            tensor.add_(torch.randn(tensor.shape, generator=generator) * scale)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--spec", type=Path, required=True, help="JSON: model sizes, corpus")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())

    corpus = [Path(p).read_text(encoding="utf-8", errors="replace") for p in spec["corpus"]]
    tokenizer = train_tokenizer(corpus, int(spec["vocab_size"]))

    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    target_dir = tmp / "target"
    target = build_target(spec["target"], len(tokenizer), int(spec["seed"]))
    target.save_pretrained(target_dir, safe_serialization=True)
    tokenizer.save_pretrained(target_dir)

    for sigma in spec["draft_noise"]:
        draft = build_target(spec["target"], len(tokenizer), int(spec["seed"]))
        draft.load_state_dict(target.state_dict())
        add_noise(draft, float(sigma), int(spec["seed"]) + 1)
        draft_dir = tmp / f"draft-noise-{sigma}"
        draft.save_pretrained(draft_dir, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (target_dir / name).exists():
                shutil.copyfile(target_dir / name, draft_dir / name)

    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
