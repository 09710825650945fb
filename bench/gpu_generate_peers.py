"""transformers' own fast decoding paths on the same task as bench/gpu_generate.sh, for issue 32's
comparison: a model directory (make_synthetic's random-weight student), ROWS prompts of a shared
CONTEXT-token context and a 20-token question, MAX_NEW sampled tokens each (temperature 1; random
weights rarely sample an end token, so every row runs to MAX_NEW).

    python3 bench/gpu_generate_peers.py DIR continuous   ROWS   (generate_batch: continuous batching,
                                                                 paged attention, prefix blocks shared)
    python3 bench/gpu_generate_peers.py DIR static-compile ROWS  (generate, static cache, torch.compile)

Prints one JSON line: rows, new tokens, seconds (the whole call, compilation and warm-up included:
a generate run pays them once), new tokens per second.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


def main() -> None:
    directory, path, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    context, max_new = int(os.environ.get("CONTEXT_TOKENS", 4096)), int(os.environ.get("MAX_NEW", 512))
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 250, (context,), generator=generator).tolist()
    questions = [shared + torch.randint(2, 250, (20,), generator=generator).tolist() for _ in range(rows // 4)]
    prompts = [q for q in questions for _ in range(4)]  # 4 samples of each question
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    settings = dict(max_new_tokens=max_new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    torch.cuda.synchronize()
    began = time.perf_counter()
    if path == "continuous":
        outputs = model.generate_batch(inputs=prompts, generation_config=GenerationConfig(**settings))
        new = sum(len(o.generated_tokens) for o in outputs.values())
    else:
        ids = torch.tensor(prompts, device="cuda")
        output = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), cache_implementation="static", **settings
        )
        new = (output.shape[1] - ids.shape[1]) * rows
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    print(
        json.dumps(
            dict(
                path=path,
                rows=rows,
                new_tokens=new,
                seconds=round(seconds, 1),
                new_tokens_per_second=round(new / seconds, 1),
                rows_per_second=round(rows / seconds, 3),
                transformers=__import__("transformers").__version__,
                torch=torch.__version__,
            )
        )
    )


if __name__ == "__main__":
    main()
