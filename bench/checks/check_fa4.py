"""Is there an attention kernel on Hopper faster than cuDNN's, for spds's long records?

FlashAttention-4 (flash-attn-4, CuTe DSL, sm90 forward and backward) against the kernels spds
runs today: cuDNN SDPA for long records, FlashAttention-2 (PyTorch's flash SDPA) for short ones.
Causal, bf16, the attention shape of Qwen3-1.7B (16 query heads, 8 key/value heads, head_dim 128),
one sequence. Times forward + backward (all of dQ, dK, dV) with CUDA events after warm-up (FA4's
first calls JIT-compile), and checks each kernel's gradient against cuDNN's.

With --spds, the same question through spds's own model (student.attention_kernel fa4, padded rows
and packed records): the summed loss and the prompt gradient of a few records against plain
transformers and PyTorch (each record alone, nothing from spds), and whether FA4's deterministic
backward (train.deterministic) repeats bit for bit where its default one does not have to.

    python bench/check.py fa4 --lengths 4096,8192,32768
    python bench/check.py fa4 --spds
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from step import HEAD_DIM, SHAPES, build_student  # noqa: E402  (it puts the repository on sys.path)
from torch.nn.attention import SDPBackend, sdpa_kernel

_, _, HEADS, KV_HEADS, _, _ = SHAPES["1.7b"]


def milliseconds(step, repeats: int = 5) -> float:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def reference_losses(segments, prompt: torch.Tensor, layers: int) -> tuple[float, torch.Tensor]:
    """The summed response cross entropy and its prompt gradient with plain transformers and
    PyTorch, nothing from spds: a fresh student of the same weights with its own SDPA attention,
    each record alone, the prompt spliced into its input embeddings at insert_at, the logits
    materialised and F.cross_entropy in fp32."""
    student = build_student("1.7b", layers)
    prompt = prompt.detach().clone().requires_grad_()
    total = 0.0
    for segment in segments:
        a, P = segment.insert_at, prompt.shape[0]
        own = student.get_input_embeddings()(segment.ids)
        joined = torch.cat([own[:a], prompt.to(own.dtype), own[a:]])[None]
        logits = student(inputs_embeds=joined).logits[0].float()
        rows = logits[segment.prefix_tokens + P - 1 : len(segment.ids) + P - 1]  # each predicts the next id
        loss = F.cross_entropy(rows, segment.ids[segment.prefix_tokens :], reduction="sum")
        loss.backward()
        total += float(loss.detach())
    del student
    torch.cuda.empty_cache()
    return total, prompt.grad


def check_spds(lengths=(700, 3000, 9000), layers: int = 4) -> None:
    """spds's SoftPromptModel with fa4 against plain transformers (reference_losses), on a
    Qwen3-1.7B-shaped student of `layers` layers (random weights): loss sum and prompt gradient."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call (deterministic part)
    from spds.contract.gate import section
    from spds.kernels.attention import use_deterministic_kernels
    from spds.model.loss import make_loss
    from spds.model.soft_prompt import Segment, SoftPromptModel

    generator = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randn(256, SHAPES["1.7b"][0], device="cuda", generator=generator) * 0.02
    segments = [
        Segment(ids=torch.randint(0, 150000, (n,), device="cuda", generator=generator), prefix_tokens=128, insert_at=3)
        for n in lengths
    ]
    loss_ref, grad_ref = reference_losses(segments, prompt, layers)
    student = build_student("1.7b", layers)  # the same seed: the reference's weights

    def run(backend: str, packed: bool, together: bool) -> tuple[float, torch.Tensor]:
        model = SoftPromptModel(
            student,
            prompt,
            make_loss(section("loss")),
            attention_kernel=backend,
            device=torch.device("cuda"),
            packed=packed,
        )
        total = 0.0
        for group in [segments] if together else [[s] for s in segments]:
            loss = model(group)
            loss.backward()
            total += float(loss.detach())
        return total, model.prompt.grad.clone()

    print(
        f"spds SoftPromptModel, {layers} layers of Qwen3-1.7B's shape, records {list(lengths)} + 256 prompt, "
        "against plain transformers (SDPA, materialised logits, F.cross_entropy), each record alone"
    )
    print("| spds kernel | layout | loss sum | rel. diff | prompt grad max |diff| / max |grad| |")
    print("|---|---|---|---|---|")
    print(f"| (reference: transformers) | one record per forward | {loss_ref:.4f} | 0 | 0 |")
    for name, backend, packed, together in (
        ("cuDNN", "cudnn", False, False),
        ("FA2 varlen (packed, without fa4)", "cudnn", True, True),
        ("FA4", "fa4", False, True),
        ("FA4 varlen", "fa4", True, True),
    ):
        loss, grad = run(backend, packed, together)
        layout = "packed" if packed else ("padded rows" if together else "one record per forward")
        loss_diff = abs(loss - loss_ref) / loss_ref
        grad_diff = float((grad - grad_ref).abs().max() / grad_ref.abs().max())
        print(f"| {name} | {layout} | {loss:.4f} | {loss_diff:.1e} | {grad_diff:.1e} |", flush=True)
    repeats = {"default": [run("fa4", True, True)[1] for _ in range(2)]}
    use_deterministic_kernels()
    repeats["deterministic"] = [run("fa4", True, True)[1] for _ in range(2)]
    for mode, (first, second) in repeats.items():
        same = "bit-identical" if torch.equal(first, second) else f"differ: max {float((first - second).abs().max())}"
        print(f"FA4 varlen, {mode} backward, run twice: prompt gradients {same}")


def options(parser) -> None:
    parser.add_argument("--lengths", default="4096,8192,32768")
    parser.add_argument("--spds", action="store_true", help="through spds's model instead (see above)")


def main(args) -> None:
    if args.spds:
        return check_spds()
    from flash_attn.cute import flash_attn_func

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | cuDNN {torch.backends.cudnn.version()}")
    print("| L | kernel | fwd+bwd ms | TFLOP/s | vs cuDNN | grad max |diff| / max |grad| vs cuDNN |")
    print("|---|---|---|---|---|---|")
    for length in map(int, args.lengths.split(",")):
        torch.manual_seed(0)
        make = dict(device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, length, HEADS, HEAD_DIM, **make).requires_grad_()  # [batch, L, heads, dim]
        k = torch.randn(1, length, KV_HEADS, HEAD_DIM, **make).requires_grad_()
        v = torch.randn(1, length, KV_HEADS, HEAD_DIM, **make).requires_grad_()
        grad_out = torch.randn(1, length, HEADS, HEAD_DIM, **make)

        def sdpa(backend):
            def step():
                q.grad = k.grad = v.grad = None
                with sdpa_kernel(backend):  # [batch, heads, L, dim]; keys and values repeated per group
                    out = F.scaled_dot_product_attention(
                        q.transpose(1, 2),
                        k.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1),
                        v.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1),
                        is_causal=True,
                    )
                out.transpose(1, 2).backward(grad_out)

            return step

        def fa4(deterministic: bool):
            def step():
                q.grad = k.grad = v.grad = None
                out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
                out = out[0] if isinstance(out, tuple) else out
                out.backward(grad_out)

            return step

        flops = 6 * HEADS * HEAD_DIM * length * length  # causal: forward 2, backward 4 (x heads x dim x L^2)
        reference = None
        kernels = [
            ("cuDNN", sdpa(SDPBackend.CUDNN_ATTENTION)),
            ("FA2 (flash SDPA)", sdpa(SDPBackend.FLASH_ATTENTION)),
            ("FA4", fa4(False)),
            ("FA4 deterministic", fa4(True)),
        ]
        for name, step in kernels:
            try:
                ms = milliseconds(step)
            except Exception as error:  # a kernel this build lacks: say so and go on
                failure = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
                print(f"| {length} | {name} | {failure} | | | |", flush=True)
                continue
            grads = torch.cat([t.grad.float().flatten() for t in (q, k, v)])
            if reference is None:
                reference, reference_ms = grads, ms
            diff = float((grads - reference).abs().max() / reference.abs().max())
            print(
                f"| {length} | {name} | {ms:.2f} | {flops / ms / 1e9:.0f} | {reference_ms / ms:.2f}x | {diff:.1e} |",
                flush=True,
            )
