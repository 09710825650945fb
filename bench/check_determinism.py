"""Which SDPA kernels give a bit-identical prompt gradient run to run (CUDA, Qwen3-0.6B shape)?"""
import os
import sys

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
torch.use_deterministic_algorithms(True, warn_only=True)
sys.path.insert(0, os.path.dirname(__file__))
from bench_gpu import build_student  # noqa: E402

from spds.contract import section  # noqa: E402
from spds.loss import make_loss  # noqa: E402
from spds.model import Segment, SoftPromptModel, initial_prompt  # noqa: E402

student = build_student("0.6b")
ids = torch.randint(0, 150000, (6000,), device="cuda")
segment = Segment(ids=ids, prefix_tokens=100, insert_at=3)
for backend in ("flash", "cudnn", "efficient", "math"):
    grads = []
    for _ in range(3):
        prompt = initial_prompt(student, 256, section("soft_prompt").init, 0)
        loss = make_loss(section("loss", kernel="auto", chunk_tokens=4096))
        model = SoftPromptModel(student, prompt, loss, False, backend)
        try:
            model([segment]).backward()
        except Exception as error:
            print(backend, "failed:", str(error).splitlines()[0][:100])
            break
        grads.append(model.prompt.grad.clone())
    if len(grads) == 3:
        print(f"{backend:9s} bit-identical over 3 runs: {all(torch.equal(grads[0], g) for g in grads[1:])}  "
              f"max |diff| {max(float((grads[0] - g).abs().max()) for g in grads[1:]):.3e}", flush=True)
