"""Fine-tune-like training in chunks, resumable bit for bit from a checkpoint.

What is trained is a LoRA adapter (rank `Hyper.rank` on the attention's q and v
projections), not the full weights: vLLM serves any number of adapters beside its one base
model (`enable_lora`, an adapter per request), so a fleet of engine workers serves every
tenant's fine-tune without an engine per model, and a checkpoint is the adapter, its
optimizer state and the RNG: kilobytes, not the model. The adapter is saved in PEFT's
format, which vLLM loads; vLLM-CPU's output with it equals transformers' with it merged.

What makes a resumed run bitwise equal to an uninterrupted one:
- the data order is a function of (seed, epoch) alone, so the data cursor is the step
  number: step s trains batch s % steps_per_epoch of epoch s // steps_per_epoch;
- the adapter's initial weights come from its own generator seeded by `seed`;
- what a step draws at random (dropout, where the model has any) comes from the trainer's
  own generator, seeded by `seed`, never from another trainer's;
- a checkpoint holds the adapter, the optimizer's state (AdamW moments and step counts),
  that generator's state and the losses so far, and is loaded into a fresh model and
  optimizer;
- every step runs single-threaded in float32, so no reduction order depends on how many
  cores the worker that resumes it has.

An engine worker trains several jobs' chunks at once, each step in a thread of one process,
where torch's default generator and its thread count are the process's. So a trainer lends
its generator to torch only for its forward pass (dropout takes no generator argument),
under a lock, and puts back what was there; and the thread count stays 1 from the first
trainer in to the last one out. A job's result is then the same alone or beside others.
(Code in the process that draws from torch's default generator during a trainer's forward
pass, other than a trainer, would still disturb it: the engine worker has none.)

A checkpoint is bytes with a SHA-256 over them: `restore` refuses bytes that do not
match the checksum the journal recorded, so a torn or corrupted file is never trained on.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

IGNORE = -100  # the label of a position that is not trained (cross_entropy's ignore_index)


@dataclass(frozen=True)
class Example:
    """One training example: its token ids and, per id, whether the model learns to
    produce it (the assistant's tokens of a chat, a completion's tokens)."""
    ids: tuple[int, ...]
    trained: tuple[bool, ...]


@dataclass(frozen=True)
class Hyper:
    n_epochs: int = 3
    batch_size: int = 1
    learning_rate: float = 1e-3
    seed: int = 0
    rank: int = 8  # vLLM serves ranks up to its max_lora_rank (8, 16, 32, …)
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update: base(x) + (alpha/r)·B·A·x,
    B zero at first so the adapter starts as the base model."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        bound = 1 / math.sqrt(base.in_features)
        self.lora_A = torch.nn.Parameter(torch.rand(rank, base.in_features, generator=generator) * 2 * bound - bound)
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scale


@dataclass
class Checkpoint:
    step: int  # steps done: the data cursor
    data: bytes
    sha256: str
    losses: list[float] = field(default_factory=list)  # one per step done, in order
    accuracies: list[float] = field(default_factory=list)  # the steps' mean token accuracy, likewise


class CorruptCheckpoint(ValueError):
    pass


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# Trainers stepping now, and the thread count before the first of them began: one that
# put its own "before" back while another stepped would let that one's reductions split
# across cores (and the last one out would leave the process at 1).
_threads = threading.Lock()
_inside = 0
_threads_before = 1


@contextmanager
def single_threaded() -> Iterator[None]:
    global _inside, _threads_before
    with _threads:
        if _inside == 0:
            _threads_before = torch.get_num_threads()
        _inside += 1
        torch.set_num_threads(1)  # in this thread too, where a build keeps counts per thread
    try:
        yield
    finally:
        with _threads:
            _inside -= 1
            if _inside == 0:
                torch.set_num_threads(_threads_before)


# Held while a trainer's generator stands in for torch's default one.
_default_generator = threading.Lock()


@contextmanager
def drawing_from(generator: torch.Generator) -> Iterator[None]:
    """torch's default CPU generator continues `generator`'s stream for the block, which
    advances it; the default's own state is put back after."""
    with _default_generator:
        outside = torch.get_rng_state()
        torch.set_rng_state(generator.get_state())
        try:
            yield
        finally:
            generator.set_state(torch.get_rng_state())
            torch.set_rng_state(outside)


def load_base(model_path: str) -> torch.nn.Module:
    """The frozen float32 base model a trainer wraps (seconds to minutes for a real one:
    engine workers keep theirs between chunks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.requires_grad_(False)
    return model


class Trainer:
    """A base model with a LoRA adapter, its optimizer and its place in the data; `run(k)`
    trains k more steps."""

    def __init__(self, model_path: str, examples: Sequence[Example], hyper: Hyper, pad_id: int,
                 base: torch.nn.Module | None = None):
        """`base`: the model at `model_path`, loaded already (`load_base`) and not in use by
        another trainer; `release` gives it back as it was."""
        if not examples:
            raise ValueError("no training examples")
        self.examples, self.hyper, self.pad_id, self.model_path = list(examples), hyper, pad_id, model_path
        self.model = base if base is not None else load_base(model_path)
        # Dropout's stream (see drawing_from); the same seed as the adapter's initial weights,
        # which draw from a generator of their own.
        self.generator = torch.Generator().manual_seed(hyper.seed)
        init = torch.Generator().manual_seed(hyper.seed)
        self.adapted: dict[str, LoRALinear] = {}  # PEFT's module path → the wrapped layer
        for name, module in list(self.model.named_modules()):
            for target in hyper.targets:
                child = getattr(module, target, None)
                if isinstance(child, torch.nn.Linear):
                    wrapped = LoRALinear(child, hyper.rank, hyper.alpha, init)
                    setattr(module, target, wrapped)
                    self.adapted[f"base_model.model.{name}.{target}"] = wrapped
        if not self.adapted:
            raise ValueError(f"the model has none of the LoRA target modules {hyper.targets}")
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=hyper.learning_rate)
        self.step = 0
        self.losses: list[float] = []
        self.accuracies: list[float] = []

    def release(self) -> torch.nn.Module:
        """The base model without this trainer's adapter, for the next trainer."""
        for path, wrapped in self.adapted.items():
            parent = self.model.get_submodule(path.removeprefix("base_model.model.").rsplit(".", 1)[0])
            setattr(parent, path.rsplit(".", 1)[1], wrapped.base)
        self.adapted = {}
        return self.model

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.adapted.values() for p in (m.lora_A, m.lora_B)]

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.examples) / self.hyper.batch_size)

    @property
    def total_steps(self) -> int:
        return self.hyper.n_epochs * self.steps_per_epoch

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def batch(self, step: int) -> list[Example]:
        """The examples of `step`: the epoch's permutation, seeded by (seed, epoch)."""
        epoch, at = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(self.examples), generator=torch.Generator().manual_seed(
            self.hyper.seed * 1_000_003 + epoch)).tolist()
        size = self.hyper.batch_size
        return [self.examples[i] for i in order[at * size:(at + 1) * size]]

    def run(self, steps: int) -> list[float]:
        """Train up to `steps` more steps (fewer at the end); the losses of those steps."""
        out = []
        with single_threaded():
            while steps > 0 and not self.done:
                loss, accuracy = self._step(self.batch(self.step))
                out.append(loss)
                self.accuracies.append(accuracy)
                self.step += 1
                steps -= 1
        self.losses += out
        return out

    def evaluate(self, examples: Sequence[Example]) -> tuple[float, float]:
        """The adapter's loss and mean token accuracy on `examples` (a validation file), over
        all their trained tokens. In eval mode and without gradients: it consumes no RNG
        and changes nothing, so evaluating never perturbs the training it interrupts."""
        total = correct = count = 0.0
        self.model.eval()
        try:
            with single_threaded(), torch.no_grad():
                for at in range(0, len(examples), self.hyper.batch_size):
                    ids, attention, labels = self._tensors(list(examples[at:at + self.hyper.batch_size]))
                    logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1]
                    target = labels[:, 1:]
                    mask = target != IGNORE
                    total += float(torch.nn.functional.cross_entropy(
                        logits[mask].float(), target[mask], reduction="sum"))
                    correct += float((logits.argmax(-1) == target)[mask].sum())
                    count += float(mask.sum())
        finally:
            self.model.train()
        return (total / count, correct / count) if count else (0.0, 0.0)

    def _tensors(self, batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(e.ids) for e in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, e in enumerate(batch):
            n = len(e.ids)
            ids[row, :n] = torch.tensor(e.ids)
            attention[row, :n] = 1
            labels[row, :n] = torch.tensor([t if trained else IGNORE for t, trained in zip(e.ids, e.trained,
                                                                                          strict=True)])
        return ids, attention, labels

    def _step(self, batch: list[Example]) -> tuple[float, float]:
        """One optimizer step; its loss and its mean token accuracy (greedy prediction =
        the trained token), as OpenAI's metrics report them."""
        ids, attention, labels = self._tensors(batch)
        # The model shifts labels itself: position i predicts token i + 1. Only the forward
        # pass draws (dropout's masks, which the backward pass reuses).
        with drawing_from(self.generator):
            out = self.model(input_ids=ids, attention_mask=attention, labels=labels)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            target = labels[:, 1:]
            mask = target != IGNORE
            accuracy = float((out.logits[:, :-1].argmax(-1) == target)[mask].float().mean()) if mask.any() else 0.0
        return float(out.loss.detach()), accuracy

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        buf = io.BytesIO()
        torch.save(dict(step=self.step, adapter=self.weights(), optimizer=self.optimizer.state_dict(),
                        rng=self.generator.get_state(), losses=self.losses, accuracies=self.accuracies), buf)
        data = buf.getvalue()
        return Checkpoint(self.step, data, checksum(data), list(self.losses), list(self.accuracies))

    def restore(self, data: bytes, sha256: str) -> None:
        """Continue from a checkpoint's bytes, which must match the recorded checksum."""
        if checksum(data) != sha256:
            raise CorruptCheckpoint(f"checkpoint checksum mismatch (expected {sha256[:12]}…, "
                                    f"got {checksum(data)[:12]}…)")
        state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
        with torch.no_grad():
            for key, tensor in state["adapter"].items():
                path, which = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
                getattr(self.adapted[path], which).copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
        # The stream's state as torch.get_rng_state() gives it: checkpoints written when
        # trainers drew from the default generator itself load as they are.
        self.generator.set_state(state["rng"])
        self.step, self.losses = int(state["step"]), [float(x) for x in state["losses"]]
        self.accuracies = [float(x) for x in state.get("accuracies", [])]

    def weights(self) -> dict[str, torch.Tensor]:
        """The adapter, keyed as PEFT saves it (`…q_proj.lora_A.weight`)."""
        return {f"{path}.{which}.weight": getattr(m, which).detach().clone()
                for path, m in self.adapted.items() for which in ("lora_A", "lora_B")}

    def save_adapter(self, out_dir: str) -> None:
        """The adapter as PEFT writes one (what vLLM's LoRARequest loads)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.weights().items()}, str(out / "adapter_model.safetensors"))
        h = self.hyper
        (out / "adapter_config.json").write_text(json.dumps(dict(
            peft_type="LORA", task_type="CAUSAL_LM", r=h.rank, lora_alpha=h.alpha, target_modules=list(h.targets),
            lora_dropout=0.0, bias="none", fan_in_fan_out=False, base_model_name_or_path=self.model_path)))


# -- examples from a training file's lines ----------------------------------------------------


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> Example:
    """A chat as the model's chat template renders it; the assistant messages' tokens are
    trained (OpenAI's default), everything else is context. Each message's tokens are
    those its rendering adds to the conversation before it."""
    ids: list[int] = []
    trained: list[bool] = []
    for i, message in enumerate(messages):
        # Rendered, then tokenized without adding special tokens again: as vLLM does a chat.
        text = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False, add_generation_prompt=False)
        upto = tokenizer.encode(text, add_special_tokens=False)
        if upto[:len(ids)] != ids:
            raise ValueError("the chat template does not render this conversation message by message")
        learn = message.get("role") == "assistant" and message.get("weight", 1) != 0
        trained += [learn] * (len(upto) - len(ids))
        ids = upto
    return Example(tuple(ids), tuple(trained))


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str) -> Example:
    p = tokenizer.encode(prompt, add_special_tokens=True)
    c = tokenizer.encode(completion, add_special_tokens=False)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return Example(tuple(p + c + eos), tuple([False] * len(p) + [True] * (len(c) + len(eos))))
