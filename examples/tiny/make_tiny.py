"""Build the tiny example from code, deterministically, with no download.

    python examples/tiny/make_tiny.py DIR

writes DIR/student (a 2-layer Qwen3ForCausalLM with random weights and a byte-level tokenizer
with a ChatML chat template), DIR/candidates.jsonl (synthetic teacher samples in both row forms)
and DIR/config.json (a run config using them). Tests import the builders from here too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# A template that adds a default system prompt when none is given: inserting an empty system
# message would change what the student sees, so spds must refuse it.
DEFAULT_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
    + CHATML_TEMPLATE
)

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def byte_level_tokenizer(specials: list[str], template: str, **special_roles):
    """A real fast tokenizer: byte-level BPE over the 256 byte symbols (no merges) + specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template, **special_roles)


def chatml_tokenizer(template: str = CHATML_TEMPLATE):
    return byte_level_tokenizer(CHATML_SPECIALS, template, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def llama3_tokenizer():
    return byte_level_tokenizer(
        LLAMA3_SPECIALS,
        LLAMA3_TEMPLATE,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
    )


def save_student(
    directory: Path, tokenizer, layers: int = 2, hidden: int = 64, seed: int = 0, initializer_range: float = 0.3
) -> Path:
    """A Qwen3ForCausalLM with random weights, saved with save_pretrained next to its tokenizer.

    Weights 15x the usual scale (std 0.3, not 0.02) make the random student's next-token
    distributions sharp, so its answers depend visibly on the system prompt: the demo's floor
    (no context) and ceiling (with it) differ by about 3 nats per token, leaving the soft prompt
    something real to recover."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


SUBJECTS = ["river", "mountain", "lantern", "harbor", "orchard", "glacier", "library", "meadow", "comet", "violin"]
FACTS = [
    "is older than it looks",
    "was named after a baker",
    "glows faintly at night",
    "hums in the key of D",
    "is visited every spring",
    "appears on the old maps",
    "was rebuilt twice",
    "faces the sea",
]
CONTEXT = "You are the archivist of Lumen Bay. Answer in one short sentence and always end with 'Archived.'"


def synthetic_rows(tokenizer, count: int = 64, seed: int = 0) -> list[dict]:
    """Teacher samples: mostly token form (some already with a system message), a few chat form."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        subject = rng.choice(SUBJECTS)
        question = f"Tell me about the {subject} (note {i})."
        more = "".join(f", and it {rng.choice(FACTS)}" for _ in range(rng.randrange(0, 4)))
        answer = f"The {subject} {rng.choice(FACTS)}" + more + ". Archived."
        sample = i % 2
        request = dict(request_id=f"q{i // 2:03d}-s{sample}", question_id=f"q{i // 2:03d}", sample_index=sample)
        messages = [{"role": "user", "content": question}]
        if i % 5 == 0:
            messages = [{"role": "system", "content": "Be brief."}, *messages]
        if i % 16 == 7:
            rows.append(dict(request, messages=messages, response=answer))
            continue
        prompt = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        response = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = list(prompt) + response
        rows.append(
            dict(
                request,
                input_ids=ids,
                prefix_tokens=len(prompt),
                labels=[-100] * len(prompt) + response,
                supervised_tokens=len(response),
                response_sha256=hashlib.sha256(answer.encode()).hexdigest(),
            )
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_questions(path: Path, count: int = 32, seed: int = 1) -> Path:
    rng = random.Random(seed)
    rows = [
        dict(question_id=f"g{i:03d}", question=f"What do you know about the {rng.choice(SUBJECTS)}?")
        for i in range(count)
    ]
    return write_jsonl(path, rows)


def tiny_config(directory: Path, name: str = "config.json", **overrides) -> dict:
    config = {
        "student": {"model_path": "student", "dtype": "bfloat16"},
        "soft_prompt": {"length": 8, "placement": "system", "init": {"method": "random_normal", "std": 0.02}},
        "data": {"candidates": [{"path": "candidates.jsonl"}], "packed_dir": "packed", "context_limit": 4096},
        "optim": {
            "updates": 30,
            "effective_batch": 8,
            "micro_batch": 1,
            "learning_rate": 0.03,
            "warmup_updates": 2,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "seed": 1,
        },
        "checkpoint": {"every": 10, "keep_last": 2},
        "deepspeed_config": "zero0",
        "output_dir": "run",
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    (directory / name).write_text(json.dumps(config, indent=2) + "\n")
    return config


def build(directory: Path, rows: int = 64) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = chatml_tokenizer()
    save_student(directory / "student", tokenizer)
    write_jsonl(directory / "candidates.jsonl", synthetic_rows(tokenizer, rows))
    tiny_config(directory)
    # The whole distillation loop: generate (teacher = the student, with CONTEXT) -> prepare ->
    # smoke -> train -> eval on held-out questions -> export.
    write_questions(directory / "questions.jsonl")
    tiny_config(
        directory,
        "loop.json",
        context={"text": CONTEXT},
        generate={
            "questions": "questions.jsonl",
            "output": "generated.jsonl",
            "samples_per_question": 2,
            "max_new_tokens": 40,
            "temperature": 0.8,
            "batch_size": 16,
            "seed": 0,
        },
        data={
            "candidates": [{"path": "generated.jsonl"}],
            "packed_dir": "loop-packed",
            "context_limit": 4096,
            "eval_fraction": 0.25,
        },
        output_dir="loop-run",
    )
    return directory / "config.json"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=str(Path(__file__).parent / "build"))
    print(build(Path(parser.parse_args().directory)))
    sys.exit(0)
