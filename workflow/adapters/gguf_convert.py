"""A Hugging Face checkpoint to GGUF through llama.cpp's own converter (`convert_hf_to_gguf.py`, which `make engines`
puts in .engines/llama-cpp/convert/ from the installed llama-cpp-python's sdist). Standalone: it runs under that
environment's python, where evident is not installed (workflow/models/gguf.py calls it).

    python gguf_convert.py --converter DIR --outtype f32|f16|bf16 CHECKPOINT OUT.gguf

The converter names a BPE tokenizer's pre-tokenizer by hashing how it encodes a test string, and refuses one it does
not know (NotImplementedError in get_vocab_base_pre): our checkpoints' byte-level BPE is one. Only there, and only
where tokenizer.json's pre-tokenizer is a plain ByteLevel one (GPT-2's regex split, no prefix space, no normalizer),
the answer is "gpt-2": llama.cpp's split for exactly that. Every other tokenizer goes through the converter unchanged
(a known hash as the converter names it, an unknown one refused as it refuses it): never a silent mislabel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def plain_byte_level(tokenizer_json: Path) -> bool:
    """Whether a tokenizer.json's text is split exactly as llama.cpp's "gpt-2" pre-tokenizer splits it."""
    try:
        tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    pre = tok.get("pre_tokenizer") or {}
    return (tok.get("normalizer") is None and (tok.get("model") or {}).get("type") == "BPE"
            and pre.get("type") == "ByteLevel" and pre.get("add_prefix_space") is False
            and pre.get("use_regex", True) is True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--converter", type=Path, required=True, help="the folder of convert_hf_to_gguf.py and its own")
    ap.add_argument("--outtype", choices=["f32", "f16", "bf16"], required=True)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    conv = args.converter.resolve()
    sys.path[:0] = [str(conv), str(conv / "gguf-py")]  # its own gguf-py, before the installed gguf package
    import convert_hf_to_gguf
    from conversion import TextModel

    known = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if plain_byte_level(Path(self.dir_model) / "tokenizer.json"):
                print('gguf_convert: the hash above is a plain ByteLevel pre-tokenizer\'s: "gpt-2"', file=sys.stderr)
                return "gpt-2"
            raise

    TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", str(args.checkpoint), "--outfile", str(args.out), "--outtype", args.outtype]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
