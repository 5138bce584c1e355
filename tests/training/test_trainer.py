"""training/trainer.py (PEFT's LoRA) on the tiny model: a run cut into chunks, each resumed
in a fresh trainer from the previous chunk's checkpoint bytes, ends with an adapter bitwise
equal to an uninterrupted run's and the same losses, with the default adapter, a job's own
rank and targets, and in bfloat16; a corrupted checkpoint is refused by its checksum; the
saved adapter, merged into the base weights by hand (W + alpha/r · B·A, as PEFT defines it)
or loaded by PEFT itself, gives the trained model's logits; a checkpoint the hand-written
trainer before PEFT wrote restores; chat examples train only the assistant's tokens, as
rendered by the model's own chat template (transformers renders it here, the oracle)."""

from __future__ import annotations

import asyncio
import io
import json
import math
import random
import re
import threading
from pathlib import Path

import pytest
import torch

from training.trainer import CorruptCheckpoint, Example, Hyper, Trainer, encode_chat, encode_prompt_completion

CHATS = [[dict(role="system", content="You answer in one word."), dict(role="user", content=f"Colour {i}?"),
          dict(role="assistant", content=random.Random(i).choice(["red", "green", "blue", "amber"]))]
         for i in range(10)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.path)


@pytest.fixture(scope="module")
def examples(tokenizer) -> list[Example]:
    return [encode_chat(tokenizer, c) for c in CHATS]


def trainer(tiny_model, tokenizer, examples, **hyper) -> Trainer:
    return Trainer(tiny_model.path, examples, Hyper(**dict(dict(n_epochs=2, batch_size=3, seed=7), **hyper)),
                   tokenizer.eos_token_id)


def test_chunks_resumed_from_checkpoints_end_bitwise_equal_to_one_run(tiny_model, tokenizer, examples):
    whole = trainer(tiny_model, tokenizer, examples)
    assert whole.total_steps == 2 * 4  # 10 examples in batches of 3: 4 steps an epoch
    whole.run(100)
    assert whole.done and len(whole.losses) == 8

    # Chunks of 3, 1 and the rest, each in a fresh trainer (as on another worker), with
    # torch's global RNG disturbed between them as other work in the process would.
    ckpt = None
    for chunk in (3, 1, 100):
        t = trainer(tiny_model, tokenizer, examples)
        if ckpt is not None:
            t.restore(ckpt.data, ckpt.sha256)
        torch.rand(5)
        t.run(chunk)
        ckpt = t.checkpoint()
    assert t.done and ckpt is not None and ckpt.step == 8
    assert t.losses == whole.losses  # the loss curve, float for float
    a, b = whole.weights(), t.weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # And training moved the weights: the comparison is not of two untouched models.
    base = trainer(tiny_model, tokenizer, examples).weights()
    assert any(not torch.equal(a[k], base[k]) for k in a)
    assert whole.losses[-1] < whole.losses[0]


def test_a_reused_base_model_trains_as_a_freshly_loaded_one(tiny_model, tokenizer, examples):
    """Engine workers keep their base model between chunks: a trainer on a base another
    trainer used (different seed, trained, released) trains bitwise as one on a fresh load,
    and the released base is the base again (its weights untouched, no adapter left)."""
    from transformers import AutoModelForCausalLM

    fresh = trainer(tiny_model, tokenizer, examples)
    fresh.run(5)
    other = trainer(tiny_model, tokenizer, examples, seed=99)
    other.run(3)
    base = other.release()
    pristine = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32).state_dict()
    assert base.state_dict().keys() == pristine.keys()
    assert not hasattr(base, "peft_config") and not any("lora" in name for name, _ in base.named_modules())
    assert all(torch.equal(base.state_dict()[k], pristine[k]) for k in pristine)
    reused = Trainer(tiny_model.path, examples, Hyper(n_epochs=2, batch_size=3, seed=7), tokenizer.eos_token_id,
                     base=base)
    reused.run(5)
    assert reused.losses == fresh.losses
    a, b = fresh.weights(), reused.weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_different_seed_trains_differently(tiny_model, tokenizer, examples):
    one, other = trainer(tiny_model, tokenizer, examples), trainer(tiny_model, tokenizer, examples, seed=8)
    one.run(2)
    other.run(2)
    assert one.losses != other.losses


def test_a_corrupted_checkpoint_is_refused_by_its_checksum(tiny_model, tokenizer, examples):
    t = trainer(tiny_model, tokenizer, examples)
    t.run(1)
    ckpt = t.checkpoint()
    flipped = bytearray(ckpt.data)
    flipped[len(flipped) // 2] ^= 0x01
    fresh = trainer(tiny_model, tokenizer, examples)
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        fresh.restore(bytes(flipped), ckpt.sha256)
    with pytest.raises(CorruptCheckpoint):
        fresh.restore(ckpt.data[: len(ckpt.data) // 2], ckpt.sha256)  # torn
    assert fresh.step == 0
    fresh.restore(ckpt.data, ckpt.sha256)
    assert fresh.step == 1


def test_a_chat_trains_the_assistants_tokens_only(tokenizer):
    chat = CHATS[0]
    ex = encode_chat(tokenizer, chat)
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert list(ex.ids) == tokenizer.encode(rendered, add_special_tokens=False)
    learned = tokenizer.decode([t for t, on in zip(ex.ids, ex.trained, strict=True) if on])
    assert learned == "<|assistant|>" + chat[2]["content"] + "\n"
    assert not any(ex.trained[: len(ex.ids) - len(tokenizer.encode(learned, add_special_tokens=False))])


def test_a_prompt_completion_trains_the_completion_and_its_end(tokenizer):
    ex = encode_prompt_completion(tokenizer, "Colour of the sky?", " blue")
    learned = [t for t, on in zip(ex.ids, ex.trained, strict=True) if on]
    assert learned == tokenizer.encode(" blue", add_special_tokens=False) + [tokenizer.eos_token_id]


def test_the_saved_adapter_merged_into_the_base_gives_the_trained_models_logits(tiny_model, tokenizer, examples,
                                                                                tmp_path):
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    t = trainer(tiny_model, tokenizer, examples)
    t.run(4)
    t.save_adapter(str(tmp_path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["target_modules"] == ["q_proj", "v_proj"]
    adapter = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 2 * 2  # 2 layers × q, v × A, B

    merged = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32)
    weights = merged.state_dict()
    scale = config["lora_alpha"] / config["r"]
    for key in adapter:
        if key.endswith("lora_A.weight"):
            layer = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            weights[f"{layer}.weight"] += scale * adapter[key.replace("lora_A", "lora_B")] @ adapter[key]
    merged.load_state_dict(weights)
    ids = torch.tensor([list(examples[0].ids)])
    t.model.eval()
    with torch.no_grad():
        trained, base_merged = t.model(input_ids=ids).logits, merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32)(input_ids=ids).logits
    assert torch.allclose(trained, base_merged, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(trained, base, atol=1e-3)  # and the adapter changed something


def test_validation_scores_a_held_out_file_without_perturbing_training(tiny_model, tokenizer, examples, tmp_path):
    """`evaluate` (a validation file's loss and token accuracy) equals what transformers
    computes with the saved adapter merged into the base: the loss over every trained
    token, and how many of them are the greedy prediction. Evaluating between steps leaves
    the run bitwise what it would have been."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    held_out = [encode_chat(tokenizer, [dict(role="user", content=f"Shade {i}?"),
                                        dict(role="assistant", content=["teal", "navy", "rust"][i % 3])])
                for i in range(5)]
    plain, scored = trainer(tiny_model, tokenizer, examples), trainer(tiny_model, tokenizer, examples)
    plain.run(6)
    scored.run(3)
    loss, accuracy = scored.evaluate(held_out)
    scored.run(3)
    assert scored.losses == plain.losses and scored.accuracies == plain.accuracies
    a, b = plain.weights(), scored.weights()
    assert all(torch.equal(a[k], b[k]) for k in a)

    again = trainer(tiny_model, tokenizer, examples)
    again.run(3)
    again.save_adapter(str(tmp_path))
    adapter = load_file(str(tmp_path / "adapter_model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32)
    weights = merged.state_dict()
    for key in adapter:
        if key.endswith("lora_A.weight"):
            layer = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            weights[f"{layer}.weight"] += (16 / 8) * adapter[key.replace("lora_A", "lora_B")] @ adapter[key]
    merged.load_state_dict(weights)
    total = correct = count = 0.0
    with torch.no_grad():
        for e in held_out:
            logits = merged(input_ids=torch.tensor([list(e.ids)])).logits[0]
            for i in range(1, len(e.ids)):
                if e.trained[i]:
                    total -= float(torch.log_softmax(logits[i - 1], -1)[e.ids[i]])
                    correct += int(logits[i - 1].argmax()) == e.ids[i]
                    count += 1
    assert count > 0 and loss == pytest.approx(total / count, rel=1e-4) and accuracy == correct / count


# -- two jobs' chunks on one engine worker at once ------------------------------------------


@pytest.fixture(scope="module")
def dropout_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model with attention dropout on, so that a training step draws from torch's
    RNG: without dropout a step draws nothing, and two trainers sharing one generator
    could not show it."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("dropout") / "model"
    shutil.copytree(tiny_model.path, out)
    config = json.loads((out / "config.json").read_text())
    config["attention_dropout"] = 0.2
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


# Two jobs with their own seeds, batch sizes and data; each cut into chunks (preempted
# after that many steps and resumed from the checkpoint in a fresh trainer).
JOBS = dict(a=(Hyper(n_epochs=2, batch_size=3, seed=7), slice(0, 10), (3, 1, 2, 100)),
            b=(Hyper(n_epochs=3, batch_size=2, seed=11), slice(2, 9), (2, 4, 1, 3, 100)))


class Worker:
    """What the engine worker's train_chunk activity does with a chunk (activities/finetune.py),
    on one event loop: a base model from the worker's idle ones (loaded if none), a trainer
    built in a thread, the checkpoint restored on the loop, each step in a thread
    (asyncio.to_thread), a validation score and a checkpoint at the end, the base given
    back. Records how many steps ran at once and each forward's torch thread count."""

    def __init__(self, path: str, pad_id: int, held_out: list[Example]):
        self.path, self.pad_id, self.held_out = path, pad_id, held_out
        self.bases: list[torch.nn.Module] = []
        self.running = self.most_at_once = 0
        self.threads: list[int] = []

    async def base(self) -> torch.nn.Module:
        if self.bases:
            return self.bases.pop()
        from training.trainer import load_base

        base = await asyncio.to_thread(load_base, self.path)
        base.register_forward_pre_hook(lambda *_: self.threads.append(torch.get_num_threads()))
        return base

    def step(self, t: Trainer) -> None:
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            t.run(1)
        finally:
            self.running -= 1

    async def job(self, examples: list[Example], hyper: Hyper, chunks: tuple[int, ...]):
        ckpt, scores = None, []
        for steps in chunks:
            t = await asyncio.to_thread(Trainer, self.path, examples, hyper, self.pad_id, await self.base())
            try:
                if ckpt is not None:
                    t.restore(ckpt.data, ckpt.sha256)
                for _ in range(steps):
                    if t.done:
                        break
                    await asyncio.to_thread(self.step, t)
                scores.append(await asyncio.to_thread(t.evaluate, self.held_out))
                ckpt = t.checkpoint()
            finally:
                self.bases.append(t.release())
        assert t.done
        return ckpt, scores


def test_two_jobs_training_at_once_on_one_worker_end_bitwise_as_each_alone(dropout_model, tokenizer, examples):
    """Two fine-tuning jobs' chunks run at once on one worker, their steps in threads of
    one process and interleaved, each preempted and resumed several times on whichever
    base model is idle: each job's final checkpoint (adapter, optimizer state, RNG, losses,
    accuracies) holds what the same job's holds trained alone in one go, value for value, and
    every step ran single-threaded. (Trainers that drew from torch's process-wide generator
    fail this: each job's dropout masks came from the other's draws.)"""
    from training.trainer import load_base

    held_out = examples[8:]
    alone = {}
    for name, (hyper, part, _) in JOBS.items():
        t = Trainer(dropout_model, examples[part], hyper, tokenizer.eos_token_id, base=load_base(dropout_model))
        t.run(1000)
        alone[name] = (t.checkpoint(), t.weights())
    # Dropout draws: the same job without it trains differently (so a shared generator
    # would show), and the two jobs' curves are not one another's.
    plain = Trainer(dropout_model, examples[JOBS["a"][1]], JOBS["a"][0], tokenizer.eos_token_id,
                    base=load_base(dropout_model))
    plain.model.config.attention_dropout = 0.0
    for layer in plain.model.model.layers:
        layer.self_attn.attention_dropout = 0.0
    plain.run(1000)
    assert plain.losses != alone["a"][0].losses

    worker = Worker(dropout_model, tokenizer.eos_token_id, held_out)

    async def both():
        return await asyncio.gather(*(worker.job(examples[part], hyper, chunks)
                                      for hyper, part, chunks in JOBS.values()))

    results = dict(zip(JOBS, asyncio.run(both()), strict=True))
    assert worker.most_at_once == 2  # the two jobs' steps did overlap
    assert worker.threads and set(worker.threads) == {1}
    for name, (ckpt, _) in results.items():
        want, weights = alone[name]
        assert ckpt.step == want.step
        assert ckpt.losses == want.losses and ckpt.accuracies == want.accuracies, name
        got = torch.load(io.BytesIO(ckpt.data), weights_only=True)
        assert all(torch.equal(got["adapter"][k], weights[k]) for k in weights), name
        # All of it, the RNG's and the optimizer's state included (value for value: pickle
        # may lay out equal floats differently after a restore, so not byte for byte).
        assert same(got, torch.load(io.BytesIO(want.data), weights_only=True)), name


def same(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple):
        return type(x) is type(y) and len(x) == len(y) and all(map(same, x, y))
    return x == y


def test_draws_from_torchs_generator_between_steps_leave_a_run_as_it_was(dropout_model, tokenizer, examples):
    """A trainer's dropout has its own stream: other code drawing from torch's default
    generator between its steps (or seeding it) changes nothing."""
    whole = trainer_on(dropout_model, tokenizer, examples)
    whole.run(1000)
    disturbed = trainer_on(dropout_model, tokenizer, examples)
    while not disturbed.done:
        torch.rand(7)
        disturbed.run(1)
        torch.manual_seed(disturbed.step)
    assert disturbed.losses == whole.losses
    a, b = whole.weights(), disturbed.weights()
    assert all(torch.equal(a[k], b[k]) for k in a)


def trainer_on(path: str, tokenizer, examples) -> Trainer:
    return Trainer(path, examples, Hyper(n_epochs=2, batch_size=3, seed=7), tokenizer.eos_token_id)


def test_the_thread_count_stays_one_while_any_trainer_steps():
    """A trainer that ends while another steps leaves torch's thread count at 1, and the
    last one out puts back what it was before the first came in. (With torch's OpenMP
    backend a thread's count is its own once it has used torch, but a thread's first use
    takes the count last set in any thread: trainers that each put back their own saw
    the second one in put back 1, and every thread the worker starts later ran on one core.
    With its native backend the count is the process's.)"""
    from training.trainer import single_threaded

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: dict[str, int] = {}
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with single_threaded():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with single_threaded():
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = torch.get_num_threads()

    try:
        threads = [threading.Thread(target=f) for f in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert first_out.is_set() and seen == {"after the first left": 1}
        assert torch.get_num_threads() == 2
        later = threading.Thread(target=lambda: seen.update(later=torch.get_num_threads()))
        later.start()
        later.join(10)
        assert seen["later"] == 2
    finally:
        torch.set_num_threads(before)


# -- PEFT's adapter: the job's rank, alpha and targets; bfloat16; checkpoints from before PEFT ---

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
BEFORE_PEFT = Path(__file__).with_name("before_peft.pt")


def resumed(make, chunks: tuple[int, ...]) -> Trainer:
    """A run cut into `chunks` of steps, each in a fresh trainer (`make()`, as on another
    worker) resumed from the previous chunk's checkpoint bytes, torch's global RNG disturbed
    between them."""
    ckpt = None
    for steps in chunks:
        t = make()
        if ckpt is not None:
            t.restore(ckpt.data, ckpt.sha256)
        torch.rand(5)
        t.run(steps)
        ckpt = t.checkpoint()
    return t


def same_run(a: Trainer, b: Trainer) -> bool:
    wa, wb = a.weights(), b.weights()
    return (a.losses == b.losses and a.accuracies == b.accuracies and wa.keys() == wb.keys()
            and all(torch.equal(wa[k], wb[k]) for k in wa))


def test_the_adapter_is_keyed_as_peft_keys_it_and_as_the_trainer_before_peft_did(tiny_model, tokenizer, examples):
    from peft import get_peft_model_state_dict

    t = trainer(tiny_model, tokenizer, examples)
    assert list(t.weights()) == [f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{which}.weight"
                                 for layer in (0, 1) for proj in ("q_proj", "v_proj") for which in "AB"]
    assert set(t.weights()) == set(get_peft_model_state_dict(t.peft))


def test_a_checkpoint_the_trainer_before_peft_wrote_restores_and_trains_on(tiny_model, tokenizer, examples):
    """before_peft.pt holds what the hand-written LoRA trainer this one replaced wrote for
    rank 2, alpha 4 on (v_proj, q_proj) with seed 7: its initial adapter, and its checkpoint
    after 2 steps. PEFT's adapter here starts from the same weights, bit for bit (drawn from
    the seed alike), keyed alike and with its parameters in the same order, so that the
    checkpoint's optimizer state lands on the parameters it belongs to; and it trains on."""
    old = torch.load(BEFORE_PEFT, weights_only=True)
    t = trainer(tiny_model, tokenizer, examples, rank=2, alpha=4.0, targets=("v_proj", "q_proj"))
    assert list(t.weights()) == list(old["initial"])  # the keys, in the optimizer's order
    assert all(torch.equal(t.weights()[k], v) for k, v in old["initial"].items())

    t.restore(old["checkpoint"], old["sha256"])
    state = torch.load(io.BytesIO(old["checkpoint"]), weights_only=True)
    assert t.step == 2 and t.losses == state["losses"]
    assert all(torch.equal(t.weights()[k], v) for k, v in state["adapter"].items())
    moments = [t.optimizer.state[p]["exp_avg"] for p in t.parameters()]
    assert all(torch.equal(m, state["optimizer"]["state"][i]["exp_avg"]) for i, m in enumerate(moments))
    t.run(2)
    assert t.step == 4 and len(t.losses) == 4 and all(math.isfinite(x) for x in t.losses)


def test_the_jobs_rank_alpha_and_targets_reach_the_adapter(tiny_model, tokenizer, examples, tmp_path):
    """Rank 4, alpha 4 on the four attention projections: the adapter has them (weights of
    the rank's shape on each), its adapter_config.json says them, and PEFT loading the saved
    adapter onto the base model (as vLLM's LoRARequest and transformers + PEFT load it) gives
    the trained model's logits, as the adapter merged by hand (W + alpha/r · B·A) does."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    t = trainer(tiny_model, tokenizer, examples, rank=4, alpha=4.0, targets=ATTENTION)
    t.run(3)
    t.save_adapter(str(tmp_path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]) == (
        "LORA", 4, 4.0, list(ATTENTION))
    assert config["base_model_name_or_path"] == tiny_model.path and config["lora_dropout"] == 0.0
    adapter = load_file(str(tmp_path / "adapter_model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32)
    layers = {f"model.layers.{i}.self_attn.{proj}" for i in (0, 1) for proj in ATTENTION}
    assert set(adapter) == {f"base_model.model.{layer}.lora_{which}.weight" for layer in layers for which in "AB"}
    for layer in layers:
        linear = base.get_submodule(layer)
        assert adapter[f"base_model.model.{layer}.lora_A.weight"].shape == (4, linear.in_features)
        assert adapter[f"base_model.model.{layer}.lora_B.weight"].shape == (linear.out_features, 4)
        assert adapter[f"base_model.model.{layer}.lora_B.weight"].abs().sum() > 0  # trained

    ids = torch.tensor([list(examples[0].ids)])
    t.model.eval()
    with torch.no_grad():
        trained = t.model(input_ids=ids).logits
        plain = base(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(base, str(tmp_path)).eval()
        by_peft = loaded(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32)
        weights = merged.state_dict()
        for layer in layers:
            a, b = (adapter[f"base_model.model.{layer}.lora_{which}.weight"] for which in "AB")
            weights[f"{layer}.weight"] += (4.0 / 4) * b @ a
        merged.load_state_dict(weights)
        by_hand = merged(input_ids=ids).logits
    assert torch.allclose(trained, by_peft, atol=1e-5, rtol=1e-5)
    assert torch.allclose(trained, by_hand, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(trained, plain, atol=1e-3)


def test_chunks_resume_bitwise_with_the_jobs_own_rank_and_targets(tiny_model, tokenizer, examples):
    hyper = dict(rank=4, alpha=8.0, targets=ATTENTION)
    whole = trainer(tiny_model, tokenizer, examples, **hyper)
    whole.run(100)
    chunked = resumed(lambda: trainer(tiny_model, tokenizer, examples, **hyper), (3, 1, 100))
    assert whole.done and chunked.done and same_run(whole, chunked)
    assert whole.losses[-1] < whole.losses[0]
    default = trainer(tiny_model, tokenizer, examples)
    default.run(100)
    assert default.losses != whole.losses  # the job's adapter is not the default one


def test_bfloat16_on_the_cpu_trains_and_resumes_bitwise(tiny_model, tokenizer, examples):
    """What the accelerator runs (the base in bfloat16, the adapter and AdamW in float32),
    smoke-tested on the CPU, where it is bitwise too. The default here is float32 on the CPU
    (this machine has no accelerator; on one, bfloat16 on CUDA is the default)."""
    from training.trainer import placement

    if not torch.cuda.is_available():
        assert placement() == (torch.device("cpu"), torch.float32)
        assert trainer(tiny_model, tokenizer, examples).device == torch.device("cpu")
    assert placement("cuda") == (torch.device("cuda"), torch.bfloat16)  # names it only: nothing runs there
    assert placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)

    def make() -> Trainer:
        return Trainer(tiny_model.path, examples, Hyper(n_epochs=2, batch_size=3, seed=7), tokenizer.eos_token_id,
                       device="cpu", dtype=torch.bfloat16)

    whole = make()
    frozen = {p.dtype for p in whole.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16} and {p.dtype for p in whole.parameters()} == {torch.float32}
    whole.run(100)
    assert whole.done and whole.losses[-1] < whole.losses[0]
    assert same_run(whole, resumed(make, (3, 1, 100)))
    single = trainer(tiny_model, tokenizer, examples)
    single.run(100)
    assert single.losses != whole.losses  # bfloat16 did run


def test_a_target_the_model_lacks_fails_naming_it_and_leaves_the_base_as_it_was(tiny_model, tokenizer, examples):
    """A job's lora_target_modules are checked where the model is: one the model lacks, or
    one that is not a linear layer, fails the trainer before the base is touched (the engine
    worker gives it to the next job), naming the module and the ones there are."""
    from training.trainer import BadTargets, load_base

    base = load_base(tiny_model.path)
    linear = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
    with pytest.raises(BadTargets, match=re.escape(f"no LoRA target module 'qkv_proj' (its linear layers: {linear})")):
        Trainer(tiny_model.path, examples, Hyper(targets=("q_proj", "qkv_proj")), tokenizer.eos_token_id, base=base)
    not_linear = "'embed_tokens' names model.embed_tokens (Embedding), not a linear layer"
    with pytest.raises(BadTargets, match=re.escape(not_linear)):
        Trainer(tiny_model.path, examples, Hyper(targets=("embed_tokens",)), tokenizer.eos_token_id, base=base)
    assert not any("lora" in name for name, _ in base.named_modules())
    reused = Trainer(tiny_model.path, examples, Hyper(n_epochs=2, batch_size=3, seed=7), tokenizer.eos_token_id,
                     base=base)
    reused.run(2)
    fresh = trainer(tiny_model, tokenizer, examples)
    fresh.run(2)
    assert same_run(reused, fresh)
