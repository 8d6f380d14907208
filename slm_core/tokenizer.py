"""A task's tokenizer: request text -> template -> token ids, every bound checked first; nothing is
truncated. The engine packs the ids into a call's preallocated buffers (slm_core.serve.runtime).

Special tokens (`<|im_end|>`, ...) are matched in the template only: a user's text that spells one
is tokenized as the characters it is, so it can neither end the prompt nor open a turn of its own
(the task key allow_special_tokens matches them in the text too). For a tokenizer whose pieces
encode differently alone than in the whole string (a Metaspace pre-tokenizer that marks only the
string's start, say), such a text is refused instead.

User text goes through tiktoken's BPE where it gives this tokenizer's ids (slm_core.fast_bpe,
checked at load), the template's pieces around it encoded once: 4-6x less CPU per text.
"""

import json

import tokenizers

from slm_core.byte_table import ByteTable
from slm_core.errors import InputError, SpecError, json_type
from slm_core.fast_bpe import FastBpe
from slm_core.pieces import Pieces

PROBES = ("probe", " two words, 12", "x\ny")  # texts without special tokens: the piecewise path must equal the whole


class PackedTokenizer:
    def __init__(
        self, tokenizer: tokenizers.Tokenizer, template: str, placeholder: str, allow_special_tokens: bool = False
    ):
        if not isinstance(template, str) or placeholder not in template:
            raise SpecError(f"task key 'prompt_template' must be a string containing {placeholder!r}")
        self.tokenizer = tokenizer
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.template, self.placeholder = template, placeholder
        # No token decodes to more characters than its vocabulary spelling has, so a text longer
        # than bound × longest spelling cannot fit: refuse it before spending time tokenizing it.
        self._longest_token = max(len(t) for t in tokenizer.get_vocab(with_added_tokens=True))
        serialized = tokenizer.to_str()
        config = json.loads(serialized)
        self._pieces = Pieces(tokenizer, config)
        self._bytes = ByteTable(tokenizer, config)
        self._specials = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._escape = bool(self._specials) and not allow_special_tokens
        if self._escape:
            # the template's own special tokens, counted with a stand-in text that spells none
            self._template_specials = self._count_specials(self.tokenizer.encode(self.apply_template("x")).ids)
            self._literal = tokenizers.Tokenizer.from_str(serialized)  # special tokens as plain text
            self._literal.encode_special_tokens = True
            self._segments = self._template_segments()
            whole = [enc.ids for enc in self.tokenizer.encode_batch_fast([self.apply_template(p) for p in PROBES])]
            self._faithful = all(self._encode_literal(p) == ids for p, ids in zip(PROBES, whole))
        self._fast = self._fast_path(config, allow_special_tokens)

    # --- build-time lookups -------------------------------------------------------------------
    def first_tokens(self, strings: tuple[str, ...], what: str) -> list[int]:
        """Each string's first token id (a label's)."""
        return [self._encode_plain(s, what)[0] for s in strings]

    def single_tokens(self, strings: tuple[str, ...], what: str) -> list[int]:
        """Each string's token id; each must be exactly one token (a stop string's)."""
        ids = []
        for s in strings:
            enc = self._encode_plain(s, what)
            if len(enc) != 1:
                raise SpecError(f"{what} {s!r} is {len(enc)} tokens {enc}; a {what} must be one token")
            ids.append(enc[0])
        return ids

    def _encode_plain(self, s: str, what: str) -> list[int]:
        ids = self.tokenizer.encode(s, add_special_tokens=False).ids
        if not ids:
            raise SpecError(f"{what} {s!r} encodes to no token")
        return ids

    # --- request path ------------------------------------------------------------------------
    def apply_template(self, text: str) -> str:
        return self.template.replace(self.placeholder, text)  # every occurrence

    def check(self, text: object, where: str, bound: str, limit: int) -> None:
        """Refuse (InputError) what no request may hold: a non-string, a blank text, one longer
        than `limit` tokens could spell, a lone surrogate (the tokenizer cannot take one)."""
        if not isinstance(text, str):
            raise InputError(f"{where} must be a string, got {json_type(text)}")
        if not text.strip():
            raise InputError(f"{where} is empty")
        if len(text) > limit * self._longest_token:
            raise InputError(
                f"{where} is {len(text)} characters, more than {bound}={limit} tokens can hold",
                bound=bound,
                limit=limit,
            )
        try:  # JSON's "\ud800" escapes decode to lone surrogates
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(
                f"{where} is not valid Unicode: a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start}"
            ) from None

    def encode(self, texts: list[str]) -> "list[list[int] | InputError]":
        """Each text's token ids with the template, in one parallel pass: long texts in pieces
        where the tokenizer allows (slm_core.pieces). A text that spells a special token is
        tokenized again, literally, or refused where this tokenizer's template pieces do not encode
        as the whole does (allow_special_tokens: taken as it is)."""
        if self._fast is not None and not any(a in s for s in texts for a in self._unspecial):
            return [self._encode_fast(s) for s in texts]
        templated = [self.apply_template(s) for s in texts]
        ids: list = (
            self._pieces.encode(templated)
            if self._pieces.usable
            else [enc.ids for enc in self.tokenizer.encode_batch_fast(templated)]
        )
        if self._escape:
            for i, text in enumerate(texts):
                if self._count_specials(ids[i]) != self._template_specials:
                    ids[i] = (
                        self._encode_literal(text)
                        if self._faithful
                        else InputError(
                            "spells a special token, which this task's tokenizer cannot take as plain text (task key "
                            "allow_special_tokens)"
                        )
                    )
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_each(self, sequences: list[list[int]]) -> list[str]:
        """decode of each sequence: by the table of token bytes where the decoder is byte-level
        (slm_core.byte_table), else one at a time, since decode_batch hands them to the
        tokenizer's threads, which take longer to wake than a call's 100-400 short candidates take
        to decode."""
        if self._bytes.usable:
            return self._bytes.decode_each(sequences)
        decode = self.tokenizer.decode
        return [decode(ids, skip_special_tokens=True) for ids in sequences]

    # --- user text by tiktoken (slm_core.fast_bpe) ---------------------------------------------
    def _fast_path(self, config: dict, allow_special_tokens: bool) -> FastBpe | None:
        """tiktoken's encoder, where the template's pieces encoded apart (user text by tiktoken,
        the post-processor's ids around them, as slm_core.pieces finds them) give the whole
        templated text's ids on the probes, special tokens matched in the template only; else None.
        A text that spells an added token the tokenizer matches in user text (a non-special one,
        self._unspecial) takes the tokenizer's path."""
        if self._specials and (allow_special_tokens or not self._faithful):
            return None
        fast = FastBpe(self.tokenizer, config)
        if not fast.usable:
            return None
        self._fast_segments = [
            (piece, None if user else self.tokenizer.encode(piece, add_special_tokens=False).ids)
            for piece, user in self._template_segments()
        ]
        self._unspecial = [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if not t.special]
        self._fast = fast
        if not all(self._encode_fast(p) == self.tokenizer.encode(self.apply_template(p)).ids for p in PROBES):
            return None
        return fast

    def _encode_fast(self, text: str) -> list[int]:
        """The templated text's ids: each template piece's fixed ids, or tiktoken's of the piece
        holding the text."""
        ids = list(self._pieces.prefix)
        for piece, fixed in self._fast_segments:
            ids += self._fast.encode(piece.replace(self.placeholder, text)) if fixed is None else fixed
        return ids + self._pieces.suffix

    # --- special tokens in the template only --------------------------------------------------
    def _count_specials(self, ids: list[int]) -> int:
        specials = self._specials
        return sum(1 for i in ids if i in specials)

    def _template_segments(self) -> list[tuple[str, bool]]:
        """The template cut at its own special tokens, as the tokenizer matches them: (piece,
        whether it holds the placeholder). A piece with the placeholder is where user text goes;
        the tokenizer never matches a special token across a piece boundary."""
        template, placeholder = self.template, self.placeholder
        enc = self.tokenizer.encode(template, add_special_tokens=False)
        segments, at = [], 0
        for token, (start, end) in zip(enc.ids, enc.offsets):
            # a special id the template spells (not, say, an unknown-character token)
            if self._specials.get(token) == template[start:end]:
                segments += [(template[at:start], placeholder in template[at:start]), (template[start:end], False)]
                at = end
        segments.append((template[at:], placeholder in template[at:]))
        return [(piece, user) for piece, user in segments if piece]

    def _encode_literal(self, text: str) -> list[int]:
        """The ids of the templated text with special tokens matched in the template's pieces only."""
        parts = [
            (self._literal if user else self.tokenizer).encode(
                piece.replace(self.placeholder, text), add_special_tokens=False
            )
            for piece, user in self._segments
        ]
        return self.tokenizer.post_process(tokenizers.Encoding.merge(parts, growing_offsets=True)).ids
