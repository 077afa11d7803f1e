"""Tokenizers (the ``tokenizers`` library) and chat templates (jinja2).

From a HF directory (``tokenizer.json`` + ``tokenizer_config.json``) or from a GGUF file's
metadata (byte-level BPE: vocabulary, merges, pre-tokenizer type, special tokens, add-BOS/EOS
flags, chat template).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence

from pallas_kernels.checks import short_repr

# Pre-tokenizer split patterns by GGUF ``tokenizer.ggml.pre`` (llama.cpp's names).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Byte-level BPE vocabularies pre-tokenized by GPT-2's regex alone. Like transformers' GGUF
# loader (the reference our tests compare with), "smollm" gets no separate digit split;
# SmolLM2's own tokenizer.json and llama.cpp isolate digits first, which only differs on a
# whitespace run directly before a digit ("x =  1": "Ġ", "Ġ", "1" here; "ĠĠ", "1" with digits first).
GGUF_BYTE_LEVEL = ("default", "gpt2", "gpt-2", "smollm", "starcoder")


class UnsupportedTokenizer(ValueError):
    """A checkpoint's tokenizer that bijax cannot build (a GGUF's SentencePiece vocabulary, an
    unknown pre-tokenizer, or no tokenizer metadata): the model itself loads and runs on token
    ids."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


class Tokenizer:
    """Text <-> token ids, plus the model's chat template.

    Attributes: ``vocab_size``, ``bos_token_id``, ``eos_token_ids`` (all ids that end a
    generation), ``chat_template`` (jinja2 source or None).
    """

    def __init__(
        self,
        backend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_eos_ids: Sequence[int] = (),
        no_template_reason: str | None = None,
    ):
        self._tok = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        eos_id = None if eos_token is None else backend.token_to_id(eos_token)
        self.eos_token_ids = tuple(dict.fromkeys([i for i in (eos_id, *extra_eos_ids) if i is not None]))
        self.chat_template = chat_template
        self._no_template_reason = no_template_reason  # why chat_template is None, if it is known
        self._template = None
        self._byte_decoder = None  # ``token_bytes``' table, made on first use
        self._added_ids: frozenset[int] = frozenset()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token (added ones too) and its id: two tokenizers with the same vocabulary read
        and write the same ids."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        # encode_batch, not encode: the same ids, but it releases Python's lock while the Rust
        # tokenizer works (a server's other requests keep going during a huge prompt)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for: whole where ``decode([i])`` cannot say them - a token
        holding part of a UTF-8 character decodes to U+FFFD alone. Byte-level BPE (GPT-2's byte
        alphabet: Llama 3, Qwen, SmolLM2) maps each character of the token back to its byte;
        SentencePiece's byte fallback tokens ``<0xNN>`` are that byte and its "▁" a space;
        added (special) tokens are their text. Any other decoder: ``decode([i])``'s UTF-8."""
        if self._byte_decoder is None:  # (once: the rule and the added tokens' ids)
            self._byte_decoder = _decoder_bytes(self._tok)
            self._added_ids = frozenset(self._tok.get_added_tokens_decoder())
        piece = self._tok.id_to_token(int(i))
        if piece is None or int(i) in self._added_ids or self._byte_decoder == "other":
            return self.decode([int(i)]).encode()
        if self._byte_decoder == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        table = self._byte_decoder
        if not all(ch in table for ch in piece):
            return self.decode([int(i)]).encode()
        return bytes(table[ch] for ch in piece)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """Renders a conversation ([{"role": ..., "content": ...}, ...]) with the model's template."""
        if not self.chat_template:
            raise ValueError(self._no_template_reason or "this tokenizer has no chat template")
        if isinstance(messages, dict) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
            if not isinstance(m["role"], str):
                raise TypeError(f"message {i}'s role must be a string, got {m['role']!r}")
        messages = [
            {**m, "content": message_text(m, f"message {i}'s content")} for i, m in enumerate(messages)
        ]
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        import jinja2

        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            # the template's own Python errors on a message it does not handle (e.g. null
            # content next to tool_calls): about the input, not from deep inside jinja
            tools = [
                i for i, m in enumerate(messages) if m.get("tool_calls") is not None or m["role"] == "tool"
            ]
            hint = (
                f" (messages {tools} are tool calls or tool results: this model's chat template may not "
                "render them)"
                if tools
                else ""
            )
            raise ValueError(
                f"chat template failed on these messages: {type(e).__name__}: {e}{hint}"
            ) from None

    def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (special tokens in the template become their ids;
        no BOS/EOS added beyond what the template writes)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt),
            add_special_tokens=False,
        )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """From a HF directory: tokenizer.json, tokenizer_config.json (special tokens, chat
        template) and chat_template.jinja if present."""
        from tokenizers import Tokenizer as Backend

        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        try:
            backend = Backend.from_file(tj)
        except Exception as e:  # the Rust library raises a plain Exception on bad JSON
            raise ValueError(f"{tj} is not a valid tokenizer.json: {e}") from None
        cfg = {}
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                try:
                    cfg = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{cfg_path} must hold a JSON object, got {type(cfg).__name__}")
        # chat_template.jinja overrides tokenizer_config.json's template (as in transformers)
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        else:
            template = cfg.get("chat_template")
        no_template = None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if template is None:  # (transformers asks for a template name then, when chatting)
                no_template = (
                    f"{cfg_path}: chat templates {sorted(map(str, named))} and none named 'default' "
                    "(bijax renders the default one)"
                )

        def token(v):
            return v.get("content") if isinstance(v, dict) else v

        # the ids that end a generation besides the tokenizer's eos_token: generation_config.json's,
        # or, without that file, config.json's (transformers' GenerationConfig.from_model_config)
        extra = []
        for name in ("generation_config.json", "config.json"):
            gen_path = os.path.join(path, name)
            if os.path.isfile(gen_path):
                with open(gen_path, encoding="utf-8") as f:
                    try:
                        gen = json.load(f)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{gen_path} is not valid JSON: {e}") from None
                if not isinstance(gen, dict):
                    raise ValueError(f"{gen_path} must hold a JSON object, got {type(gen).__name__}")
                eos = gen.get("eos_token_id")
                extra = [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
                break
        return cls(
            backend,
            bos_token=token(cfg.get("bos_token")),
            eos_token=token(cfg.get("eos_token")),
            chat_template=template,
            extra_eos_ids=extra,
            no_template_reason=no_template,
        )

    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        """From a GGUF file's metadata (``models.gguf.open_gguf(path)``); byte-level BPE only."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as Backend

        md = reader.metadata
        kind = md.get("tokenizer.ggml.model")
        if kind is None:
            raise UnsupportedTokenizer("the GGUF file has no tokenizer metadata (tokenizer.ggml.model)")
        if kind != "gpt2":
            raise UnsupportedTokenizer(
                f"unsupported GGUF tokenizer model {kind!r}: bijax builds byte-level BPE ('gpt2') tokenizers"
            )
        tokens = md.get("tokenizer.ggml.tokens")
        merges = md.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise UnsupportedTokenizer(
                "GGUF tokenizer metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges"
            )
        types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = md.get("tokenizer.ggml.pre", "default")
        if pre not in GGUF_SPLITS and pre not in GGUF_BYTE_LEVEL:
            known = sorted(GGUF_SPLITS) + sorted(GGUF_BYTE_LEVEL)
            raise UnsupportedTokenizer(
                f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(known)})"
            )

        alphabet = set(_bytes_to_unicode().values())
        spell = _bytes_to_unicode()
        vocab = {}
        for i, t in enumerate(tokens):
            if not set(t) <= alphabet:  # stored as raw text: respell in the byte alphabet
                t = "".join(spell[b] for b in t.encode("utf-8"))
            vocab.setdefault(t, i)
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = Backend(
            models.BPE(
                vocab=vocab, merges=pairs, fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix=""
            )
        )
        if pre in GGUF_SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(GGUF_SPLITS[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types, strict=False)
            if ty == 3 and set(t) <= alphabet
        ]
        backend.add_special_tokens(control)
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty == 4 and t in vocab
        ]
        if user:
            backend.add_tokens(user)

        def tok(key):
            i = md.get(f"tokenizer.ggml.{key}")
            return None if i is None or not 0 <= i < len(tokens) else tokens[i]

        bos, eos = tok("bos_token_id"), tok("eos_token_id")
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            single = " ".join(
                ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
            )
            pair = (
                single
                + " "
                + " ".join(([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
            )
            special = [
                (t, backend.token_to_id(t))
                for t in dict.fromkeys(x for x in (bos if add_bos else None, eos if add_eos else None) if x)
            ]
            backend.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=special
            )
        eot = md.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            chat_template=md.get("tokenizer.chat_template"),
            extra_eos_ids=[eot] if eot is not None else [],
        )


def message_text(message: dict, name: str) -> str | None:
    """A chat message's content as the template's string: a string, or OpenAI's list of text
    parts ({"type": "text", "text": str}) joined by newlines (as vLLM joins them); None only
    beside a non-empty ``tool_calls`` (an assistant's tool call, which templates render without
    content); ``tool_calls``, where given, a list of objects (clients send [] for none).
    TypeError naming ``name`` otherwise."""
    content = message.get("content")
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        field = name[: -len("content")] + "tool_calls" if name.endswith("content") else f"{name}'s tool_calls"
        raise TypeError(f"{field} must be a list of objects, got {short_repr(calls, 80)}")
    if isinstance(content, str) or (content is None and calls):
        return content
    parts = isinstance(content, list) and content
    if parts and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "\n".join(p["text"] for p in content)
    raise TypeError(
        f"{name} must be a string or a non-empty list of {{'type': 'text', 'text': str}} parts, got "
        f"{short_repr(content, 80)}"
    )


def _compile_template(source: str):
    """A sandboxed jinja2 template with the helpers HF chat templates use."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' marker of the assistant's
        tokens, for its assistant mask): the body rendered as it is, as transformers renders it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e}") from None


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a HF directory or a .gguf file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return Tokenizer.from_pretrained(path)
    if os.path.isfile(path):
        from models.gguf import open_gguf

        return Tokenizer.from_gguf(open_gguf(path))
    raise FileNotFoundError(f"no tokenizer at {path} (expected a HF directory or a .gguf file)")


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
    other 68 are shifted past 255 (256 + k for the k-th such byte, in byte order)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), 256),
    ]
    table, shift = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + shift)] = b
            shift += 1
    return table


def _decoder_bytes(backend):
    """``token_bytes``' rule for a ``tokenizers`` backend: GPT-2's byte table for a ByteLevel
    decoder, "sentencepiece" for byte fallback (``<0xNN>``) with "▁" spaces, else "other"."""
    import json

    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return _gpt2_byte_alphabet()
    if "ByteFallback" in kinds:
        return "sentencepiece"
    return "other"
