"""LoRA adapters written by peft itself over a model's own weights, for the LoRA tests: random
non-zero A and B (peft leaves B at zero unless told), saved as peft saves them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

# every projection a LoRA may target
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(base: Path, out: Path, seed: int, scale: float = 0.05, **config: Any) -> Any:
    """A peft model over the checkpoint ``base`` with one adapter of ``config`` (a
    ``peft.LoraConfig``'s fields) whose B is random; saved to ``out``. Returns the peft model
    (eval mode, float32)."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(seed)
    lora = peft.LoraConfig(init_lora_weights=False, **config)
    wrapped = peft.get_peft_model(model, lora).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    wrapped.save_pretrained(str(out))
    return wrapped


def peft_greedy(model: Any, ids: list[int], max_tokens: int, adapter: bool = True) -> list[int]:
    """The greedy continuation of ``ids`` through the peft model (or its base), ``max_tokens``
    long whatever it picks (argmax of each step's last logits: no stop rule)."""
    out = list(ids)
    for _ in range(max_tokens):
        out.append(int(peft_logits(model, out, adapter).argmax()))
    return out[len(ids):]


def peft_logits(model: Any, ids: list[int], adapter: bool = True) -> torch.Tensor:
    """The peft model's (or its base's) logits at the last position of ``ids``."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        if adapter:
            return model(prompt).logits[0, -1]
        with model.disable_adapter():
            return model(prompt).logits[0, -1]
