"""A checkpoint as GGUF, for llama.cpp targets: made by llama.cpp's own converter (`convert_hf_to_gguf.py`, which
`make engines` puts in .engines/llama-cpp/convert/), run under the engine environment's python through
workflow/adapters/gguf_convert.py. No torch here: the converter's imports live in that environment.

The result is cached by content: `cache/<key>/model.gguf`, the key a hash over the checkpoint's files, the outtype,
the converter (its script, package and gguf-py) and the shim. It is written under a temporary name in the same folder
and renamed when complete, so an interrupted conversion leaves nothing that looks done.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

from evident.workflow.core.evidence import canonical_json, make_dirs, sha256_bytes, sha256_file
from evident.workflow.models.checkpoints import cached_sha256

SHIM = Path(__file__).resolve().parents[1] / "adapters" / "gguf_convert.py"
SCRIPT = "convert_hf_to_gguf.py"
GGML = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # ggml's type names: outtypes, llama.cpp's KV types
OUTTYPES = tuple(GGML.values())
CACHE = Path(".evident/gguf")  # the converted files, under the working directory


class ConvertError(RuntimeError):
    """A conversion that cannot run or failed: the message says what to do or where the converter's output is."""


def converter_sha256(converter: Path) -> str:
    """The converter's code: the script, its conversion/ package and its gguf-py (a new llama.cpp changes any)."""
    code = [converter / SCRIPT, *converter.glob("conversion/**/*.py"), *converter.glob("gguf-py/gguf/**/*.py")]
    files = {str(f.relative_to(converter)): sha256_file(f) for f in code} | {"shim": sha256_file(SHIM)}
    return sha256_bytes(canonical_json(files))


def cache_key(ckpt: Path, outtype: str, converter: Path) -> str:
    """Every file of the checkpoint (config, tokenizer, weights: whatever the converter may read), by content."""
    files = {p.name: cached_sha256(p) for p in sorted(ckpt.iterdir()) if p.is_file()}
    key = {"files": files, "outtype": outtype, "converter": converter_sha256(converter)}
    return sha256_bytes(canonical_json(key))[:32]


def convert(ckpt: Path, python: str, converter: Path, outtype: str, cache: Path, log: Path) -> dict:
    """The checkpoint as a GGUF of `outtype` (f32, f16, bf16), converted or taken from the cache: {path, sha256,
    outtype, converter, cached}. The converter's output is appended to `log`."""
    ckpt, converter = Path(ckpt), Path(converter)
    if outtype not in OUTTYPES:
        raise ConvertError(f"GGUF outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    if not (converter / SCRIPT).is_file():
        raise ConvertError(f"llama.cpp's converter is not in {converter} (no {SCRIPT}): run `make engines`")
    key = cache_key(ckpt, outtype, converter)
    out = cache / key / "model.gguf"
    label = f"llama.cpp {SCRIPT} ({sha256_file(converter / SCRIPT)[:12]})"
    cached = out.is_file()
    if cached:
        print(f"[gguf] cached {key}/{out.name}", flush=True)
    else:
        print(f"[gguf] converting {ckpt.name} with llama.cpp's converter ({outtype}) ...", flush=True)
        t0 = time.perf_counter()
        make_dirs(out.parent)
        make_dirs(log.parent)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".model.", suffix=".gguf.part")
        os.close(fd)
        try:
            with open(log, "ab") as logf:
                argv = [python, str(SHIM), "--converter", str(converter), "--outtype", outtype, str(ckpt), tmp]
                try:
                    rc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT).returncode
                except OSError as e:
                    raise ConvertError(f"cannot run {python!r} for llama.cpp's converter ({e.strerror}): "
                                       "run `make engines`") from e
            if rc != 0:
                raise ConvertError(f"llama.cpp's converter failed on {ckpt} ({outtype}, exit {rc}): "
                                   f"its output is in {log}")
            os.chmod(tmp, 0o644)  # mkstemp's 0600
            os.replace(tmp, out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        print(f"[gguf] {key}/{out.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return {"path": out, "sha256": cached_sha256(out), "outtype": outtype, "converter": label, "cached": cached}
