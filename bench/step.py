"""GPU benchmark: spds's real training step against HF transformers + PEFT prompt tuning.

    python bench/step.py --model 1.7b --cases fixed:4096,16384,32768 mix:64 --out results.json

Both run on the same random-weight Qwen3-shaped student (built from a config on the GPU, no
download), 256 virtual tokens, micro-batch 1. spds runs its own code path: a packed store on
disk, Plan/deal, SoftPromptModel, the DeepSpeed engine and train_step (exact SUM, fused CE).
HF+PEFT runs get_peft_model(PromptTuningConfig) with gradient checkpointing, one record per
optimizer step, the loss from the model's own forward (materialised logits), as a user would.

--second-visit times a second update over the same records after the first (--trace-visits, up to
64eeae1, traced the difference); --profile first profiles the first visit (host time too).

Useful FLOPs per position = 4 x matmul parameters (lm_head included) + 6 x layers x seq x
heads x head_dim (forward and input-gradient backward, causal attention, no recompute); MFU is
that over the measured bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import common  # noqa: E402
from common import HEAD_DIM, SHAPES, VOCAB, qwen3_config  # noqa: E402,F401

DEVICE = "cuda"
PROMPT = 256
PREFIX = 128  # prompt-side tokens of each synthetic record; the rest is supervised response
# the system header before the prompt's insertion point, the same in every record (the online
# teacher's cached context is kept per header: random headers made every record its own prefix,
# so the cached teacher recomputed the context for each record and packed none of them)
HEADER = 3


def build_student(name: str, layers: int | None = None):
    return common.build_student(name, DEVICE, layers)


def matmul_parameters(name: str) -> int:
    hidden, layers, heads, kv, inter, _ = SHAPES[name]
    per_layer = hidden * heads * HEAD_DIM * 2 + hidden * kv * HEAD_DIM * 2 + 3 * hidden * inter
    return layers * per_layer + VOCAB * hidden


def useful_flops(name: str, positions: list[int]) -> float:
    hidden, layers, heads, *_ = SHAPES[name]
    p = matmul_parameters(name)
    return float(sum(4 * p * n + 6 * layers * heads * HEAD_DIM * n * n for n in positions))


def measure_peak_tflops() -> float:
    if DEVICE == "cpu":
        return 1.0
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * 8192**3 / float(np.median(times)) / 1e12


# ---------------------------------------------------------------- spds


def write_store(directory: Path, lengths: list[int], seed: int = 0, top_k: int = 0):
    """A packed store of random records of `lengths` (with `top_k`, each supervised token carries an
    offline teacher's top-k: distinct ids, log-probabilities summing below 1)."""
    from spds.data.packed import PackedStore, PackedWriter
    from spds.data.rows import Record

    rng = np.random.default_rng(seed)
    writer = PackedWriter(directory)
    header = rng.integers(0, VOCAB - 1000, HEADER).astype(np.uint32)
    shares = np.log(0.9 * np.arange(top_k, 0, -1) / (top_k * (top_k + 1) / 2)).astype(np.float32)
    for i, length in enumerate(lengths):
        ids = rng.integers(0, VOCAB - 1000, length).astype(np.uint32)
        ids[:HEADER] = header  # every record opens with the same system header, as a chat template's do
        supervised = length - min(PREFIX, length // 2)
        top = {}
        if top_k:
            first = rng.integers(0, VOCAB - top_k, supervised)[:, None]
            top = dict(
                top_ids=(first + np.arange(top_k)).astype(np.int32),
                top_logprobs=np.broadcast_to(shares, (supervised, top_k)).copy(),
            )
        writer.add(
            Record(
                request_id=f"r{i}",
                question_id=f"q{i}",
                sample_index=0,
                ids=ids,
                prefix_tokens=min(PREFIX, length // 2),
                insert_at=HEADER,
                response_sha256="0" * 64,
                added_system=False,
                source=f"synthetic:{i}",
                **top,
            ),
            "train",
        )
    files = writer.close_files()
    header_ids = [int(i) for i in header]
    end = [VOCAB - 1]  # never the random records' ids: the sampler's end token (loss.on_policy)
    no_file = "0" * 64
    writer.commit(  # a complete manifest (PackedStore.open checks it against its schema)
        dict(
            format="spds-packed-v1",
            spds_version="bench",
            records=len(lengths),
            tokens=int(sum(lengths)),
            max_length=int(max(lengths)),
            top_k=top_k,
            prompt_length=PROMPT,
            placement="system",
            scaffold=dict(lead=[], system_header=header_ids, system_close=[], user_header=[]),
            end_token_ids=end,
            counts=dict(
                existing_system=len(lengths), added_empty_system=0, prefix_placement=0, train=len(lengths), eval=0
            ),
            files=files,
            sources=[dict(path="synthetic", sha256=no_file, rows=len(lengths))],
            inputs=dict(
                sources=[dict(path="synthetic", sha256=no_file)],
                tokenizer=no_file,
                placement="system",
                prompt_length=PROMPT,
                context_limit=int(max(lengths)) + PROMPT,
                end_token_ids=end,
                chat_template_kwargs={},
                eval_fraction=0.0,
            ),
        )
    )
    return PackedStore.open(directory)


# spds variants: config overrides (student, optim) on top of the schema's defaults.
BY_LENGTH = {"below": 8192, "short": "flash", "long": "cudnn"}
KERNELS = ("flash", "cudnn", "flex", "fa4")
VARIANTS = {
    "default": ({}, {}),
    "packed": ({"attention_kernel": BY_LENGTH}, {"micro_batch": 16, "micro_batch_tokens": 16384}),
    # Liger's RMSNorm/SwiGLU/RoPE patch the shared student in place: run these in an invocation
    # of their own, with --no-peft.
    "liger": ({"attention_kernel": BY_LENGTH, "liger_kernels": True}, {"micro_batch": 16, "micro_batch_tokens": 16384}),
}
# one kernel at every length (FlashAttention-4: flash-attn-4, bench/check.py fa4), padded rows
VARIANTS.update({f"liger-{k}": ({"attention_kernel": k, "liger_kernels": True}, VARIANTS["liger"][1]) for k in KERNELS})
# train.deterministic (its kernel choice, strict deterministic algorithms) against liger
VARIANTS["liger-det"] = ({"liger_kernels": True}, VARIANTS["liger"][1])
# liger with the records of a forward end to end (variable-length attention, no padding)
VARIANTS["liger-packed"] = (VARIANTS["liger"][0], {**VARIANTS["liger"][1], "micro_batch_layout": "packed"})
VARIANTS["liger-packed-fa4"] = (VARIANTS["liger-fa4"][0], VARIANTS["liger-packed"][1])
VARIANTS["liger-packed-fa4-det"] = VARIANTS["liger-packed-fa4"]  # its deterministic backward (train.deterministic)
DETERMINISTIC = {"liger-det", "liger-packed-fa4-det"}
# loss.objective kl with the online teacher (the student with a CONTEXT-token context): its keys
# and values computed once (kl) or the whole sequence every time (kl-nocache); packed, the cached
# teacher packs a pass's records in one forward. loss.teacher top_k: KL against the top-k every
# record carries (no teacher forward). student.fp8_linear: the decoder's linear layers quantized in
# place (the shared student: list it last).
VARIANTS["kl"] = VARIANTS["kl-nocache"] = VARIANTS["packed"]
for base in ("liger", "liger-packed", "liger-packed-fa4"):
    VARIANTS[f"{base}-kl"] = VARIANTS[f"{base}-kl-nocache"] = VARIANTS[base]
for base in ("packed", "liger-packed", "liger-packed-fa4"):
    VARIANTS[f"{base}-topk"] = VARIANTS[base]
    VARIANTS[f"{base}-fp8"] = VARIANTS[base]
TOPK, CONTEXT = 20, 4096


def fp8_linears(model) -> None:
    from spds.kernels.fp8 import FrozenFP8Linear, quantize_linears

    if not any(isinstance(m, FrozenFP8Linear) for m in model.modules()):  # once: the student is shared
        quantize_linears(model.student)
    torch.cuda.empty_cache()


def online_kl(reuse_context: bool, memo_gib: float = 0.0):
    def attach(model) -> None:
        from spds.contract.gate import section
        from spds.model.loss import make_loss
        from spds.model.teacher import ContextTeacher

        model.loss_fn = make_loss(section("loss", objective="kl"))
        context = torch.from_numpy(np.random.default_rng(1).integers(0, VOCAB - 1000, CONTEXT)).to(DEVICE)
        return ContextTeacher(model, context, reuse_context=reuse_context, memo_gib=memo_gib)

    return attach


def offline_kl(model):
    from spds.contract.gate import section
    from spds.model.loss import make_loss
    from spds.model.teacher import TopKTeacher

    model.loss_fn = make_loss(section("loss", objective="kl", teacher="top_k"))
    return TopKTeacher()


def teacher_flops(name: str, lengths: list[int]) -> float:
    """The least the online teacher must compute for records of `lengths` after a cached CONTEXT:
    a forward (2 x matmul parameters a position) with causal attention over the context and the
    record's own earlier positions. Against useful_flops (the step's forward and input-gradient
    backward), 1 + this / that is the KL step's floor at the CE step's FLOP rate."""
    hidden, layers, heads, *_ = SHAPES[name]
    p = matmul_parameters(name)
    return float(sum(2 * p * n + 2 * layers * heads * HEAD_DIM * (n * n + 2 * n * CONTEXT) for n in lengths))


# loss.teacher_memo_gib: the teacher's states kept per record. Timed on a second visit of the same
# records (a later epoch), after a timed first visit (first_visit_seconds).
VARIANTS["liger-kl-memo"] = VARIANTS["liger-kl-nocache-memo"] = VARIANTS["liger"]
REVISIT = {"liger-kl-memo", "liger-kl-nocache-memo"}


# soft_prompt.form kv (issue 55): the same step with a key and value at every layer for each of the
# PROMPT positions in place of input embeddings (spds/model/kv_prompt.py)
VARIANTS["liger-packed-kv"] = VARIANTS["liger-packed"]
VARIANTS["packed-kv"] = ({}, VARIANTS["liger-packed"][1])  # without Liger: the CPU's
VARIANTS["liger-packed-fa4-kv"] = VARIANTS["liger-packed-fa4"]
# loss.on_policy: the liger-packed-kl step with half of each batch answered by the student first
# (512 new tokens, spds's decoder; the random student never ends an answer early). Its time is the
# sampling and the step; the sampling's share is reported apart.
VARIANTS["onpolicy"] = VARIANTS["kl"]
VARIANTS["liger-packed-onpolicy"] = VARIANTS["liger-packed-kl"]
VARIANTS["liger-packed-fa4-onpolicy"] = VARIANTS["liger-packed-fa4-kl"]
ON_POLICY = dict(fraction=0.5, temperature=1.0, max_new_tokens=512)
AFTER_BUILD = {
    "kl": online_kl(True),
    "kl-nocache": online_kl(False),
    "liger-kl": online_kl(True),
    "liger-kl-nocache": online_kl(False),
    "liger-packed-kl": online_kl(True),
    "liger-packed-kl-nocache": online_kl(False),
    "liger-packed-fa4-kl": online_kl(True),
    "liger-packed-fa4-kl-nocache": online_kl(False),
    **{f"{base}-topk": offline_kl for base in ("packed", "liger-packed", "liger-packed-fa4")},
    **{f"{base}-fp8": fp8_linears for base in ("packed", "liger-packed", "liger-packed-fa4")},
    "onpolicy": online_kl(True),
    "liger-packed-onpolicy": online_kl(True),
    "liger-packed-fa4-onpolicy": online_kl(True),
    "liger-kl-memo": online_kl(True, memo_gib=64.0),
    "liger-kl-nocache-memo": online_kl(False, 64.0),
}


def spds_config(directory: Path, records: int, variant: str):
    from spds.contract.config import Config
    from spds.contract.schema import apply_defaults, describe_errors, load_schema

    student, optim = VARIANTS[variant]
    if DEVICE == "cpu":  # a dry run: CPU SDPA has the math kernel only
        student = {k: v for k, v in student.items() if k != "attention_kernel"}
    raw = {
        "student": {"model_path": "random-weights", **student},
        "soft_prompt": {"length": PROMPT, "form": "kv" if variant.endswith("-kv") else "embeddings"},
        "data": {"candidates": [{"path": "synthetic"}]},
        "optim": {"effective_batch": records, "updates": 1, "learning_rate": 1e-3, **optim},
        "train": {"require_smoke": False, "deterministic": variant in DETERMINISTIC},
        "output_dir": str(directory / "run"),
    }
    apply_defaults(raw, load_schema("config"))
    assert not describe_errors(raw, "config"), describe_errors(raw, "config")
    return Config(path=directory / "config.json", raw=raw)


def time_spds(
    student, name: str, lengths: list[int], variant: str, warm_lengths: list[int], second_visit: bool = False
) -> dict:
    """One timed update over `lengths` after one warm-up update over `warm_lengths` (with
    `second_visit`, the second of two updates over `lengths`)."""
    from spds.model.build import build_soft_prompt_model
    from spds.stop import StopRequest
    from spds.training.engine import build_engine, init_distributed
    from spds.training.schedule import Plan
    from spds.training.train import train_step

    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        store = write_store(directory / "packed", warm_lengths + lengths, top_k=TOPK if "topk" in variant else 0)
        config = spds_config(directory, len(lengths), variant)
        if not torch.distributed.is_initialized():
            init_distributed(config.distributed)
        if config.student.liger_kernels and not getattr(student, "liger_applied", False):
            from spds.model.student import apply_liger_kernels

            apply_liger_kernels(student)
            student.liger_applied = True
        if config.train.deterministic:
            from spds.kernels.attention import use_deterministic_kernels

            use_deterministic_kernels()
        model = build_soft_prompt_model(config, torch.device(DEVICE), student=student)
        teacher = AFTER_BUILD.get(variant, lambda model: None)(model)  # the online-KL variants' teacher
        sampler = None
        if variant.endswith("onpolicy"):
            from spds.contract.settings import OnPolicySettings
            from spds.data.student_files import decodable_ids, load_tokenizer
            from spds.training.on_policy import Sampler

            vocabulary = decodable_ids(load_tokenizer(config), model.student.config.vocab_size)
            sampler = Sampler(OnPolicySettings(**ON_POLICY), model, store.manifest["end_token_ids"], 0, vocabulary)
        policy, recomputed = model.recompute, []  # layers recomputed, per micro-batch
        model.recompute = lambda *args, **kwargs: recomputed.append(policy(*args, **kwargs)) or recomputed[-1]
        engine = build_engine(config, model, 1)
        plan = Plan(store, config.optim, model.inserted_positions, 1)
        device = torch.device(DEVICE)
        stop = StopRequest()  # not installed: nothing asks this benchmark to stop
        warm = np.arange(len(warm_lengths))
        step = plan.step_of(1, warm)  # the warm-up: kernels, JIT
        samples = sampler.for_step(store, step, device) if sampler else None
        train_step(engine, teacher, store, plan, step, 0, device, stop, None, samples)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        batch = np.arange(len(warm_lengths), len(warm_lengths) + len(lengths))
        extra = {}
        if second_visit or variant in REVISIT:  # the first visit of the timed records, then the timed second one
            started = time.perf_counter()
            with profiled(PROFILE == "first"):
                step = plan.step_of(2, batch)
                samples = sampler.for_step(store, step, device) if sampler else None
                train_step(engine, teacher, store, plan, step, 0, device, stop, None, samples)
                torch.cuda.synchronize()
            extra = dict(first_visit_seconds=time.perf_counter() - started)
            if hasattr(teacher, "memo_bytes"):
                extra["teacher_memo_gib"] = teacher.memo_bytes / 2**30
        if hasattr(teacher, "prefix_forwards"):  # the cached teacher computes a header's context once
            extra["teacher_prefix_forwards"] = teacher.prefix_forwards
        recomputed.clear()
        started = time.perf_counter()
        with profiled(PROFILE == "timed"):
            step = plan.step_of(3, batch)
            samples = sampler.for_step(store, step, device) if sampler else None
            metric, _ = train_step(engine, teacher, store, plan, step, 0, device, stop, None, samples)
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        if samples:
            extra.update(sampling_seconds=samples.seconds, sampled_tokens=samples.metric()["sampled_tokens"])
            extra.update(decode_graphs=sampler.decoder.captured)
        result = dict(
            seconds=seconds,
            positions=metric["tokens"],
            peak_gib=torch.cuda.max_memory_allocated() / 2**30,
            loss=metric["loss"],
            kernel=model.loss_fn.kernel,
            recomputed_layers=sum(recomputed),
            micro_batches=len(recomputed),
            **extra,
        )
        del engine, model
        torch.cuda.empty_cache()
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        return result


# ---------------------------------------------------------------- where the time goes

PROFILE = None  # --profile: "timed" (the timed update) or "first" (its first visit)
KERNEL_KINDS = (  # GPU kernel name pattern -> what it is (first match)
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("liger/triton", ("liger", "triton", "_rms", "rope", "swiglu")),
    ("communication", ("nccl", "gloo")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill", "cat")),
    ("reduction/softmax", ("reduce", "softmax", "logsumexp", "max", "sum")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in lowered for w in words)), "other")


@contextlib.contextmanager
def profiled(enabled: bool):
    """torch.profiler over the timed update: GPU time by kind of kernel, and the top kernels."""
    if not enabled:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    wall = time.perf_counter() - started
    # GPU kernels only: a host-side op's entry carries its kernels' time again. Filtering out aten::
    # ops alone (before the ninth session) counted twice the kernels that Python autograd functions
    # launch themselves (FlashAttention-4's through TVM FFI, Liger's).
    from torch.autograd import DeviceType

    kernels = [
        (e.key, e.self_device_time_total)
        for e in prof.key_averages()
        if e.self_device_time_total > 0 and e.device_type == DeviceType.CUDA
    ]
    total = sum(t for _, t in kernels) or 1
    by_kind: dict[str, float] = {}
    for name, t in kernels:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0) + t
    print(f"profiled update: {wall:.2f} s wall, {total / 1e6:.2f} s of GPU kernels", flush=True)
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    print(
        "host time, the largest self CPU totals: "
        + ", ".join(f"{e.key[:60]} {e.self_cpu_time_total / 1e6:.2f} s ({e.count})" for e in host),
        flush=True,
    )
    print(
        "GPU time by kind: "
        + ", ".join(
            f"{k} {v / 1e6:.2f} s ({100 * v / total:.0f}%)" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        ),
        flush=True,
    )
    for name, t in sorted(kernels, key=lambda kv: -kv[1])[:12]:
        print(f"  {t / 1e6:7.3f} s {100 * t / total:4.1f}%  {name[:110]}", flush=True)


# ---------------------------------------------------------------- HF + PEFT


def time_peft(
    student, lengths: list[int], warm_lengths: list[int], second_visit: bool = False, peer: str = "ckpt"
) -> dict:
    """peer ckpt: gradient checkpointing, the model's own kernels. liger: the strongest peer a user
    gets in one line, Liger's kernels patched in (its fused linear cross-entropy included, as
    apply_liger_kernel_to_qwen3 does by default) and no checkpointing; Liger's RoPE on its Triton
    kernel, the faster of its two (bench/RESULTS.md, the step against HF+PEFT)."""
    from peft import PromptTuningConfig, TaskType, get_peft_model

    if peer == "liger":
        os.environ["LIGER_KERNEL_IMPL_ROPE"] = "nvidia-triton"
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3(model=student)
    model = get_peft_model(student, PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=PROMPT))
    if peer == "ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rng = np.random.default_rng(0)

    def step(length: int) -> None:
        ids = torch.from_numpy(rng.integers(0, VOCAB - 1000, length)).to(DEVICE)[None]
        labels = ids.clone()
        labels[:, : min(PREFIX, length // 2)] = -100
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed() -> float:
        started = time.perf_counter()
        for length in lengths:
            step(length)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    for length in warm_lengths:
        step(length)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    extra = dict(first_visit_seconds=timed()) if second_visit else {}
    seconds = timed()
    peak = torch.cuda.max_memory_allocated() / 2**30
    model.unload() if hasattr(model, "unload") else None
    student.gradient_checkpointing_disable()
    model = optimizer = None  # the step closure holds them
    gc.collect()
    torch.cuda.empty_cache()  # what follows starts from the same free memory as a fresh process
    return dict(seconds=seconds, positions=sum(lengths) + PROMPT * len(lengths), peak_gib=peak, **extra)


# ---------------------------------------------------------------- driver


def guarded(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs)
    except torch.OutOfMemoryError as error:
        torch.cuda.empty_cache()
        return dict(error=f"OOM: {str(error).splitlines()[0][:120]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(SHAPES))
    parser.add_argument(
        "--cases",
        nargs="+",
        required=True,
        help="fixed:L1,L2,...[:records]  or  mix:RECORDS[:SEED]  (log-uniform 512-32k)",
    )
    parser.add_argument("--variants", default="default", help="comma list of spds variants: " + ", ".join(VARIANTS))
    parser.add_argument("--no-peft", action="store_true")
    parser.add_argument("--prompt", type=int, default=256, help="the soft prompt's length p (a -kv variant: its keys)")
    parser.add_argument(
        "--peer",
        choices=("ckpt", "liger"),
        default="ckpt",
        help="HF+PEFT with gradient checkpointing (ckpt), or with Liger patched in and no checkpointing "
        "(liger: it patches the student in place, so only with spds's Liger variants)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--profile",
        nargs="?",
        const="timed",
        choices=("timed", "first"),
        default=None,
        help="torch.profiler over each timed spds update, or (first) over its first visit",
    )
    parser.add_argument(
        "--second-visit",
        action="store_true",
        help="time a second update over the same records (both systems), after a timed first one: "
        "the steady state of a long run, where every shape's kernels and plans exist",
    )
    args = parser.parse_args()
    global PROFILE, PROMPT
    PROFILE, PROMPT = args.profile, args.prompt
    liger = [v for v in args.variants.split(",") if VARIANTS[v][0].get("liger_kernels")]
    if liger and len(liger) < len(args.variants.split(",")):
        parser.error(f"{liger} patch the student in place: run them in an invocation of their own")
    if args.peer == "liger" and len(liger) < len(args.variants.split(",")):
        parser.error("--peer liger patches the student in place: run it with spds's Liger variants only")
    import transformers

    global DEVICE
    if not torch.cuda.is_available():
        DEVICE = "cpu"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            setattr(torch.cuda, name, lambda *a, **k: None)
        torch.cuda.max_memory_allocated = lambda *a, **k: 0
        torch.cuda.get_device_name = lambda *a, **k: "cpu (dry run)"

    peak = measure_peak_tflops()
    header = (
        f"{time.strftime('%Y-%m-%d')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"transformers {transformers.__version__} | measured bf16 matmul peak {peak:.0f} TFLOP/s"
    )
    print(header, flush=True)
    student = build_student(args.model)
    rows, cases = [], []
    for case in args.cases:
        kind, spec, *rest = case.split(":")
        if kind == "mix":  # steady state: one update over another mix first, then the timed one
            rng = np.random.default_rng(int(rest[0]) if rest else 0)

            def draw():
                return [int(x) for x in np.exp(rng.uniform(math.log(512), math.log(32768), int(spec)))]

            warm_lengths = draw()
            groups = [(f"mix {spec} records 512-32k" + (f" seed {rest[0]}" if rest else ""), draw())]
        else:
            records = int(rest[0]) if rest else 4
            groups = [(f"{int(L) / 1024:g}k x {records}", [int(L)] * records) for L in spec.split(",")]
            warm_lengths = None
        cases += [(label, lengths, warm_lengths or lengths) for label, lengths in groups]
    # HF+PEFT first, on the student as built: spds's Liger variants patch it in place.
    for label, lengths, warm in cases if not args.no_peft else []:
        result = guarded(time_peft, student, lengths, warm, args.second_visit, args.peer)
        flops = useful_flops(args.model, [n + PROMPT for n in lengths])
        system = "HF+PEFT ckpt" if args.peer == "ckpt" else "HF+PEFT + Liger, no ckpt"
        rows.append(dict(model=args.model, case=label, system=system, **result, flops=flops))
        common.record(**rows[-1])
    for label, lengths, warm in cases:
        flops = useful_flops(args.model, [n + PROMPT for n in lengths])
        for variant in args.variants.split(","):
            result = guarded(time_spds, student, args.model, lengths, variant, warm, args.second_visit)
            rows.append(dict(model=args.model, case=label, system=f"spds {variant}", **result, flops=flops))
            common.record(**rows[-1])
    print()
    print(header)
    visits = "second visit " if args.second_visit else ""
    print(f"| model | case | system | {visits}tokens/s | peak GiB | MFU | vs HF+PEFT | first visit tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    baseline = {(r["case"]): r for r in rows if r["system"].startswith("HF") and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['case']} | {r['system']} | {r['error']} | | | |")
            continue
        rate = r["positions"] / r["seconds"]
        mfu = r["flops"] / r["seconds"] / (peak * 1e12)
        base = baseline.get(r["case"])
        ratio = f"{rate / (base['positions'] / base['seconds']):.2f}x" if base else ""
        first = f"{r['positions'] / r['first_visit_seconds']:,.0f}" if "first_visit_seconds" in r else ""
        cells = [r["model"], r["case"], r["system"], f"{rate:,.0f}", f"{r['peak_gib']:.1f}", f"{mfu:.0%}", ratio, first]
        print("| " + " | ".join(map(str, cells)) + " |")
    for label, lengths, _ in cases:  # the online teacher's least cost at the CE step's FLOP rate
        floor = 1 + teacher_flops(args.model, lengths) / useful_flops(args.model, [n + PROMPT for n in lengths])
        print(
            f"{label}: the online teacher's forward (context cached) is {floor - 1:.2f} of the step's useful FLOPs: "
            f"a KL step at the CE step's FLOP rate takes at least {floor:.2f}x the CE step"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(dict(header=header, peak_tflops=peak, rows=rows), indent=1))


if __name__ == "__main__":
    main()
