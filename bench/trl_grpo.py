"""TRL's GRPOTrainer on tiny_arith: the single-process baseline that `bench/vs_trl.py` runs.

    <trl python> bench/trl_grpo.py SETUP.json OUT.json

It runs in TRL's own interpreter (TRL pins its own accelerate/datasets; dsv4rl is not imported here).
SETUP.json, written by `vs_trl.py` from the dsv4rl recipe, names the model (a transformers directory of
the same tiny DeepSeek-V4 weights), the prompts in the order dsv4rl's seeded stream gives them, and the
hyper-parameters. TRL generates in-process with `model.generate` and trains in the same process.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

START = time.perf_counter()  # the wall time counts imports and model loading, as dsv4rl's does

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def exact_answer(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """dsv4rl's `arith` grader for a one-token answer: the stripped response starts with the integer."""
    numbers = (re.match(r"-?\d+", text.strip()) for text in completions)
    return [float(m is not None and m.group(0) == truth) for m, truth in zip(numbers, answer, strict=True)]


def main(setup_path: str, out_path: str) -> None:
    setup = json.loads(Path(setup_path).read_text())
    hp = setup["hyper"]
    torch.manual_seed(setup["seed"])
    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32)
    rows = [{"prompt": tokenizer.bos_token + p["prompt"], "answer": p["answer"]} for p in setup["prompts"]]
    config = GRPOConfig(
        output_dir=setup["output_dir"],
        max_steps=hp["steps"],
        per_device_train_batch_size=hp["prompts_per_step"] * hp["group_size"],
        gradient_accumulation_steps=1,
        num_generations=hp["group_size"],
        max_completion_length=hp["max_new_tokens"],
        temperature=hp["temperature"],
        top_p=hp["top_p"],
        learning_rate=hp["lr"],
        adam_beta1=hp["betas"][0],
        adam_beta2=hp["betas"][1],
        adam_epsilon=hp["eps"],
        weight_decay=hp["weight_decay"],
        max_grad_norm=hp["grad_clip"],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": hp["min_lr_ratio"]},
        warmup_steps=0,
        beta=hp["kl_coef"],
        router_aux_loss_coef=0.0,  # dsv4rl trains no load-balancing loss (DeepSeek-V4 balances by bias)
        epsilon=hp["eps_clip_low"],
        epsilon_high=hp["eps_clip_high"],
        loss_type="dapo",  # token mean over the batch, dsv4rl's token_mean
        num_iterations=1,
        shuffle_dataset=False,  # the prompts are already in dsv4rl's seeded order
        seed=setup["seed"],
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_answer,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    step_times: list[float] = []
    last = [time.perf_counter()]

    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, *args: object, **kwargs: object) -> None:
            now = time.perf_counter()
            step_times.append(now - last[0])
            last[0] = now

    trainer.add_callback(StepClock())
    last[0] = time.perf_counter()
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    result = {
        "wall_s": time.perf_counter() - START,
        "step_times_s": step_times,
        "rewards": rewards,
        "torch_threads": torch.get_num_threads(),
        "versions": {name: __import__(name).__version__ for name in ("trl", "transformers", "torch")},
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
