"""Train the testbed's tiny checkpoints on the CPU, deterministically, from local text only.

This script runs with the vLLM environment's interpreter (it needs torch, tokenizers and
transformers, which specpilot itself does not depend on), so it imports nothing from
specpilot. ``testbed.environment.ModelSet`` calls it and caches the result.

The corpus is text every machine of this kind has: Python standard-library sources
(code), JSON records derived from those sources' definitions (JSON), and the Python
reference's prose plus licence texts (English). Everything trains single-threaded from
fixed seeds, so the same inputs give the same weights, and the build leaves the second
core to whatever else runs.

Output layout under ``OUT``:

- ``target/``: a ``LlamaForCausalLM`` trained on the corpus, with a byte-level BPE
  tokenizer trained here.
- ``draft/``: a smaller ``LlamaForCausalLM`` trained on the same corpus, carrying the
  target's tokenizer files byte for byte, as a real draft must.
- ``eagle/``: an EAGLE-1 head (``EagleLlamaForCausalLM``) distilled from the target's
  final hidden states; it shares the target's embeddings and LM head, as vLLM loads it.
- ``eagle3/``: an EAGLE-3 head (``Eagle3LlamaForCausalLM``) distilled from three of the
  target's intermediate hidden states, with its own norm and LM head.
- ``report.json``: held-out loss per corpus part for each model, and how long each took.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
BOS, EOS, PAD = 1, 2, 3
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
RMS_EPS = 1e-6
ROPE_THETA = 10000.0


def _log(message: str) -> None:
    print(f"[build_models] {message}", file=sys.stderr, flush=True)


# --- corpus -------------------------------------------------------------------------


def _definitions_as_json(path: Path, source: str) -> str:
    """The module's functions and classes as JSON records: JSON the model can learn
    from, made from text on this machine."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    records = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        doc = ast.get_docstring(node)
        record: dict[str, Any] = {
            "name": node.name,
            "kind": "class" if isinstance(node, ast.ClassDef) else "function",
            "module": path.stem,
            "line": node.lineno,
        }
        if not isinstance(node, ast.ClassDef):
            record["args"] = [a.arg for a in node.args.args]
            record["returns"] = ast.unparse(node.returns) if node.returns else None
        record["doc"] = doc.splitlines()[0] if doc else None
        records.append(record)
    return json.dumps(records, indent=2) if records else ""


def _pydoc_topics(path: Path) -> list[str]:
    """The Python reference's prose: the string values of ``pydoc_data/topics.py``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    texts: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for value in node.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    texts.append(value.value)
    return texts


def read_corpus(spec: dict[str, Any]) -> dict[str, list[str]]:
    """Documents per corpus part: ``code``, ``json`` and ``prose``."""
    code, data = [], []
    for name in spec["corpus"]["code"]:
        source = Path(name).read_text(encoding="utf-8", errors="replace")
        code.append(source)
        records = _definitions_as_json(Path(name), source)
        if records:
            data.append(records)
    prose = [Path(p).read_text(encoding="utf-8", errors="replace") for p in spec["corpus"]["prose"]]
    for name in spec["corpus"]["pydoc_topics"]:
        prose += _pydoc_topics(Path(name))
    return {"code": code, "json": data, "prose": prose}


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


class Batches:
    """Training windows drawn from the corpus parts in fixed proportions.

    Each part is one token stream (documents joined by EOS); its last ``holdout``
    fraction is kept out of training for the held-out losses in the report.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        parts: dict[str, list[str]],
        mix: dict[str, float],
        holdout: float,
    ) -> None:
        self.train: dict[str, torch.Tensor] = {}
        self.heldout: dict[str, torch.Tensor] = {}
        for name, docs in parts.items():
            ids: list[int] = []
            for doc in docs:
                ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [EOS]
            stream = torch.tensor(ids, dtype=torch.long)
            cut = int(len(stream) * (1 - holdout))
            self.train[name], self.heldout[name] = stream[:cut], stream[cut:]
        self.mix = mix

    def sizes(self) -> dict[str, int]:
        return {name: len(stream) for name, stream in self.train.items()}

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``batch`` windows of ``length`` tokens, each part's share per ``mix``."""
        names = sorted(self.mix)
        weights = torch.tensor([self.mix[n] for n in names])
        picks = torch.multinomial(weights, batch, replacement=True, generator=generator)
        rows = []
        for pick in picks.tolist():
            stream = self.train[names[pick]]
            start = int(torch.randint(0, len(stream) - length, (1,), generator=generator))
            rows.append(stream[start : start + length])
        return torch.stack(rows)

    def heldout_windows(self, length: int, count: int) -> dict[str, torch.Tensor]:
        windows = {}
        for name, stream in self.heldout.items():
            n = min(count, len(stream) // length)
            windows[name] = stream[: n * length].view(n, length)
        return windows


# --- training -----------------------------------------------------------------------


def _schedule(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    name: str,
    params: list[nn.Parameter],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    batches: Batches,
    run: dict[str, Any],
    seed: int,
) -> float:
    """Optimise ``loss_fn`` over sampled windows; returns the seconds it took."""
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.AdamW(params, lr=float(run["lr"]), betas=(0.9, 0.95), weight_decay=0.1)
    steps, warmup = int(run["steps"]), int(run["warmup"])
    started, cpu = time.monotonic(), time.process_time()
    for step in range(steps):
        for group in optimiser.param_groups:
            group["lr"] = _schedule(step, steps, float(run["lr"]), warmup)
        window = batches.sample(int(run["batch"]), int(run["length"]), generator)
        loss = loss_fn(window)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        if step % 25 == 0 or step == steps - 1:
            elapsed, used = time.monotonic() - started, time.process_time() - cpu
            _log(
                f"{name}: step {step + 1}/{steps} loss {loss.item():.3f} "
                f"({elapsed:.0f} s, {used:.0f} CPU s)"
            )
    return time.monotonic() - started


def llama(spec: dict[str, Any], vocab_size: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=int(spec["hidden_size"]),
        intermediate_size=int(spec["intermediate_size"]),
        num_hidden_layers=int(spec["num_hidden_layers"]),
        num_attention_heads=int(spec["num_attention_heads"]),
        num_key_value_heads=int(spec["num_attention_heads"]),
        max_position_embeddings=int(spec["max_position_embeddings"]),
        initializer_range=0.02,
        rms_norm_eps=RMS_EPS,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def bigram_init(model: LlamaForCausalLM, batches: Batches, smoothing: float = 0.1) -> None:
    """Start the embeddings and LM head from the corpus's bigram statistics.

    A few hundred steps on one core leave a model from random weights near the unigram
    loss; starting it where embed → norm → LM head already predicts the next token from
    the current one (a rank-``hidden`` factorisation of the centred log-bigram matrix)
    lets training spend its steps on what needs context.
    """
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    counts = torch.full((vocab, vocab), smoothing)
    for stream in batches.train.values():
        pairs = stream[:-1] * vocab + stream[1:]
        counts += torch.bincount(pairs, minlength=vocab * vocab).view(vocab, vocab).float()
    logp = torch.log(counts / counts.sum(1, keepdim=True))
    centred = logp - logp.mean(1, keepdim=True)
    u, sv, vh = torch.linalg.svd(centred, full_matrices=False)
    root = sv[:hidden].sqrt()
    left, right = u[:, :hidden] * root, vh[:hidden].T * root
    # After RMSNorm each embedding has unit RMS: scale the LM head by the mean row RMS
    # so that logits keep about the bigram matrix's scale.
    scale = left.pow(2).mean(1).sqrt().mean()
    model.model.embed_tokens.weight.copy_(left / left.pow(2).mean(1, keepdim=True).sqrt())
    model.lm_head.weight.copy_(right * scale)


def lm_loss(model: LlamaForCausalLM) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(window: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=window[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())

    return loss


# --- EAGLE heads: the arithmetic of vLLM's llama_eagle.py / llama_eagle3.py -----------


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding, as vLLM and transformers apply it to Llama."""
    dim = x.shape[-1]
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions[:, None].float() * inv[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[None, :, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[None, :, None, :]
    half = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-half[1], half[0]], -1) * sin


class HeadLayer(nn.Module):
    """One Llama decoder layer whose attention input may be wider than its residual
    (EAGLE-3 concatenates embeddings and hidden states into it)."""

    def __init__(self, hidden: int, intermediate: int, heads: int, attn_in: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(attn_in, hidden, bias=False)
        self.k_proj = nn.Linear(attn_in, hidden, bias=False)
        self.v_proj = nn.Linear(attn_in, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        shape = (b, t, self.heads, self.head_dim)
        q = rotate(self.q_proj(x).view(shape), positions)
        k = rotate(self.k_proj(x).view(shape), positions)
        return q, k, self.v_proj(x).view(shape)

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj, residual add, post-attention norm, MLP, residual add (pre-norm sum)."""
        residual = self.o_proj(attended.flatten(2)) + residual
        h = rms_norm(residual, self.post_attention_layernorm)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + residual

    def weights(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {
            f"{prefix}self_attn.{p}.weight": getattr(self, p).weight
            for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        }
        out |= {
            f"{prefix}mlp.{p}.weight": getattr(self, p).weight
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        out[f"{prefix}post_attention_layernorm.weight"] = self.post_attention_layernorm
        return out


def attend_two_passes(
    layer: HeadLayer,
    first: tuple[torch.Tensor, ...],
    second: tuple[torch.Tensor, ...] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention for the first pass; the second pass (the head's second draft
    step) sees the first pass strictly before its position plus itself, as vLLM's KV
    cache holds it when the head drafts its second token."""
    q1, k1, v1 = (x.transpose(1, 2) for x in first)
    out1 = F.scaled_dot_product_attention(q1, k1, v1, is_causal=True)
    if second is None:
        return out1.transpose(1, 2), None
    q2, k2, v2 = (x.transpose(1, 2) for x in second)
    t = q1.shape[2]
    scale = 1.0 / math.sqrt(q1.shape[-1])
    before = torch.ones(t, t, dtype=torch.bool).tril(-1)
    scores = (q2 @ k1.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~before, float("-inf"))
    own = (q2 * k2).sum(-1, keepdim=True) * scale
    weights = torch.softmax(torch.cat([scores, own], -1), -1)
    out2 = weights[..., :t] @ v1 + weights[..., t:] * v2
    return out1.transpose(1, 2), out2.transpose(1, 2)


class TwoStepHead(nn.Module):
    """A one-layer draft head run for two draft steps: the first reads the target's
    state, the second the head's own output from the position before."""

    layer: HeadLayer

    def first_input(
        self, embeds: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) for the first draft step."""
        raise NotImplementedError

    def next_input(
        self, embeds: torch.Tensor, previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) for a later step, from the head's own output."""
        raise NotImplementedError

    def forward(
        self, embeds: torch.Tensor, state: torch.Tensor, positions: torch.Tensor
    ) -> list[torch.Tensor]:
        x1, r1 = self.first_input(embeds, state)
        first = self.layer.project(x1, positions)
        with torch.no_grad():
            out1, _ = attend_two_passes(self.layer, first, None)
            y1 = self.layer.finish(out1, r1)
        # Second draft step at position s: the head's own output from s - 1.
        x2, r2 = self.next_input(embeds, torch.cat([y1[:, :1], y1[:, :-1]], 1))
        second = self.layer.project(x2, positions)
        out1, out2 = attend_two_passes(self.layer, first, second)
        assert out2 is not None
        return [self.layer.finish(out1, r1), self.layer.finish(out2, r2)]


class EagleHead(TwoStepHead):
    """EAGLE-1 (``EagleLlamaForCausalLM``): fc([embed(next token), feature]) then one
    decoder layer without input norm; its output is both the next feature and what the
    target's LM head reads (vLLM applies no norm in between)."""

    def __init__(self, hidden: int, intermediate: int, heads: int) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = HeadLayer(hidden, intermediate, heads, hidden)

    def first_input(
        self, embeds: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat([embeds, state], -1))
        return x, x

    def next_input(
        self, embeds: torch.Tensor, previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first_input(embeds, previous)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        return {"fc.weight": self.fc.weight, **self.layer.weights("layers.0.")}


class Eagle3Head(TwoStepHead):
    """EAGLE-3 (``Eagle3LlamaForCausalLM``): fc over three target hidden states; one
    layer whose attention reads [norm(embed), norm(hidden)]; a final norm and LM head.
    The pre-norm output feeds the next draft step."""

    def __init__(self, hidden: int, intermediate: int, heads: int, aux: int, vocab: int) -> None:
        super().__init__()
        self.fc = nn.Linear(aux * hidden, hidden, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        self.layer = HeadLayer(hidden, intermediate, heads, 2 * hidden)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def first_input(
        self, embeds: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_input(embeds, self.fc(state))

    def next_input(
        self, embeds: torch.Tensor, previous: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = [rms_norm(embeds, self.input_layernorm), rms_norm(previous, self.hidden_norm)]
        return torch.cat(normed, -1), previous

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(y, self.norm))

    def checkpoint(self) -> dict[str, torch.Tensor]:
        return {
            "fc.weight": self.fc.weight,
            "midlayer.input_layernorm.weight": self.input_layernorm,
            "midlayer.hidden_norm.weight": self.hidden_norm,
            **self.layer.weights("midlayer."),
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head.weight,
        }


class TargetView:
    """What the heads learn from: the frozen target's hidden states and next-token
    distributions over a window."""

    def __init__(self, target: LlamaForCausalLM, aux_layers: list[int]) -> None:
        layers = target.config.num_hidden_layers
        if not all(0 < i < layers for i in aux_layers):
            raise ValueError(f"EAGLE-3 aux layer ids must lie in 1..{layers - 1}: {aux_layers}")
        self.target, self.aux_layers = target, aux_layers

    @torch.no_grad()
    def __call__(self, window: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.target(input_ids=window, output_hidden_states=True)
        # The embeddings, the residual stream entering each later layer, and last the
        # final normed state (what vLLM hands an EAGLE-1 head). vLLM's EAGLE-3 aux state
        # for layer id L is the stream entering layer L, so ids run 1 .. layers - 1.
        states = out.hidden_states
        return {
            "final": states[-1],
            "aux": torch.cat([states[i] for i in self.aux_layers], -1),
            "probs": torch.softmax(out.logits, -1),
            "embeds": self.target.model.embed_tokens(window),
        }


def distillation_loss(
    head: EagleHead | Eagle3Head, view: TargetView, lm_head: nn.Linear
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The head sees (token t + 1, target state t) at position t and learns the target's
    next-token distribution at t + 1 (soft cross-entropy); EAGLE-1 also regresses the
    target's feature at t + 1, which its next step reads. Both draft steps train."""

    def loss(window: torch.Tensor) -> torch.Tensor:
        seen = view(window)
        positions = torch.arange(window.shape[1] - 1)
        embeds = seen["embeds"][:, 1:]
        state = seen["final"] if isinstance(head, EagleHead) else seen["aux"]
        outputs = head(embeds, state[:, :-1], positions)
        total = torch.zeros(())
        for k, y in enumerate(outputs):
            # Both steps at position s draft token s + 2 (step 2 from the head's own
            # output at s - 1, so it has no position 0).
            target_probs = seen["probs"][:, 1 + k :]
            y = y[:, k:]
            logits = lm_head(y) if isinstance(head, EagleHead) else head.logits(y)
            ce = -(target_probs * F.log_softmax(logits, -1)).sum(-1).mean()
            total = total + ce
            if isinstance(head, EagleHead):
                total = total + F.smooth_l1_loss(y, seen["final"][:, 1 + k :])
        return total

    return loss


# --- saving -------------------------------------------------------------------------


def save_head(
    head: EagleHead | Eagle3Head,
    target_dir: Path,
    out: Path,
    architecture: str,
    extra: dict[str, Any],
    intermediate: int,
) -> None:
    out.mkdir(parents=True)
    config = json.loads((target_dir / "config.json").read_text())
    config.update(
        architectures=[architecture], num_hidden_layers=1, intermediate_size=intermediate, **extra
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().contiguous().clone() for k, v in head.checkpoint().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, out / name)


@torch.no_grad()
def heldout_loss(
    loss_fn: Callable[[torch.Tensor], torch.Tensor], windows: dict[str, torch.Tensor]
) -> dict[str, float]:
    return {name: round(float(loss_fn(w)), 4) for name, w in windows.items() if len(w)}


def chunks(windows: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for i in range(0, len(windows), size):
        yield windows[i : i + size]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--spec", type=Path, required=True, help="JSON: sizes, runs, corpus")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    seed = int(spec["seed"])
    report: dict[str, Any] = {"seconds": {}, "heldout_loss": {}}
    started = time.monotonic()

    parts = read_corpus(spec)
    tokenizer = train_tokenizer([d for docs in parts.values() for d in docs], spec["vocab_size"])
    batches = Batches(tokenizer, parts, spec["mix"], float(spec["holdout"]))
    report["train_tokens"] = batches.sizes()
    _log(f"corpus tokens per part: {batches.sizes()}")
    windows = batches.heldout_windows(int(spec["target"]["run"]["length"]), 16)

    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    target_dir, draft_dir = tmp / "target", tmp / "draft"

    for name, folder, model_seed in (("target", target_dir, seed), ("draft", draft_dir, seed + 1)):
        model_spec = spec[name]
        model = llama(model_spec["model"], len(tokenizer), model_seed)
        bigram_init(model, batches)
        report["seconds"][name] = train(
            name, list(model.parameters()), lm_loss(model), batches, model_spec["run"], model_seed
        )
        model.eval()
        report["heldout_loss"][name] = heldout_loss(lm_loss(model), windows)
        model.save_pretrained(folder, safe_serialization=True)
        if name == "target":
            tokenizer.save_pretrained(folder)
            target = model
        for file in TOKENIZER_FILES:
            if name == "draft" and (target_dir / file).exists():
                shutil.copyfile(target_dir / file, folder / file)
    for p in target.parameters():
        p.requires_grad_(False)

    hidden = target.config.hidden_size
    heads = target.config.num_attention_heads
    aux_layers = list(spec["eagle3"]["aux_layers"])
    view = TargetView(target, aux_layers)
    for name in ("eagle", "eagle3"):
        head_spec = spec[name]
        torch.manual_seed(seed + 2)
        intermediate = int(head_spec["intermediate_size"])
        head: EagleHead | Eagle3Head
        if name == "eagle":
            head = EagleHead(hidden, intermediate, heads)
            extra: dict[str, Any] = {}
        else:
            head = Eagle3Head(hidden, intermediate, heads, len(aux_layers), len(tokenizer))
            head.lm_head.weight.data.copy_(target.lm_head.weight)
            extra = {
                "draft_vocab_size": len(tokenizer),
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layers},
            }
        loss_fn = distillation_loss(head, view, target.lm_head)
        report["seconds"][name] = train(
            name, list(head.parameters()), loss_fn, batches, head_spec["run"], seed + 2
        )
        report["heldout_loss"][name] = heldout_loss(loss_fn, windows)
        arch = "EagleLlamaForCausalLM" if name == "eagle" else "Eagle3LlamaForCausalLM"
        save_head(head, target_dir, tmp / name, arch, extra, intermediate)

    report["seconds"]["total"] = time.monotonic() - started
    (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(f"done in {report['seconds']['total']:.0f} s: {report['heldout_loss']}")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
