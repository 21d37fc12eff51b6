"""llama.cpp's own quantizer on a GGUF, for ``bench_decoder_sizes.py --llama-quantize``: run by the llama-cpp venv.

    python _llama_quantize.py IN.gguf OUT.gguf TYPE [THREADS]

``llama_model_quantize`` through llama-cpp-python with ``llama-quantize``'s defaults (not ``--pure``): the type for
the projections, and llama.cpp's own choice for the rest, e.g. Q6_K for the output head (a tied model's token
embedding) of a Q4_0 file. This is what a llama.cpp user gets from ``llama-quantize model-f32.gguf out.gguf Q4_0``.
"""

from __future__ import annotations

import sys


def main() -> None:
    import llama_cpp

    src, out, qtype = sys.argv[1], sys.argv[2], sys.argv[3]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    code = llama_cpp.llama_model_quantize(src.encode(), out.encode(), params)
    if code:
        raise SystemExit(f"llama_model_quantize({src}, {qtype}) returned {code}")


if __name__ == "__main__":
    main()
